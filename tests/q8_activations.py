"""The 8-bit activations generation's quantized matmuls take, for references that run in torch:
llama.cpp's quantize_row_q8_0, which ferrum's quantizer (cpp/quant/quantize.cpp) follows."""
import numpy as np
import torch


def q8_0_rounded(x, order=None):
    """x rounded block by block of 32 (of the inputs in `order`, the order a weight's columns hold
    them: GPTQ act-order): d = max|x| / 127, q = x * (1 / d) rounded half away from zero, read
    back as q * f16(d)."""
    if order is not None:
        return q8_0_rounded(x[..., order])[..., np.argsort(order)]
    b = x.reshape(-1, 32)
    d = b.abs().amax(1, keepdim=True) / 127
    v = b * torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)
    return (q * d.half().float()).reshape(x.shape)


def greedy_both_ways(model, path, prompt, n):
    """n greedy tokens after `prompt` from a transformers `model` of the checkpoint at `path`,
    each module ferrum holds quantized taking its input rounded as q8_0_rounded does (in the
    order its columns hold the inputs), and from ferrum on that checkpoint: (reference, ferrum)."""
    import ferrum
    from conftest import greedy_tokens
    mf = ferrum._core.ModelFile(str(path))
    quantized = lambda name: mf.tensors.get(name, ("f32",))[0] not in ("f32", "f16", "bf16")
    for name, m in model.named_modules():
        if quantized(name + ".weight"):
            order = mf.input_order(name + ".weight")
            m.register_forward_pre_hook(lambda mod, args, order=order: (q8_0_rounded(args[0], order),))
        elif hasattr(m, "gate_up_proj") and quantized(name + ".0.gate_proj.weight"):
            m.forward = experts_rounding_inputs(m, lambda e, proj, name=name: mf.input_order(f"{name}.{e}.{proj}_proj.weight"))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    llm = ferrum.LLM(str(path), kv_dtype="f32", num_threads=2)
    params = ferrum.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return ids[len(prompt):], greedy_tokens(llm, [prompt], params)[0]


def experts_rounding_inputs(experts, order=lambda e, proj: None):
    """A forward for transformers' fused MoE experts (gate_up_proj [E, 2I, H], down_proj [E, H, I],
    as Qwen3MoeExperts computes them) whose every expert takes its gate / up input and its down
    input rounded as q8_0_rounded does, in the order its columns hold them (order(e, "gate") /
    order(e, "down"): act-order): as ferrum's quantized expert kernels take them."""
    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(experts.gate_up_proj.shape[0]):
            tokens, slots = torch.where(top_k_index == e)
            if len(tokens) == 0:
                continue
            gate, up = torch.nn.functional.linear(q8_0_rounded(hidden_states[tokens], order(e, "gate")),
                                                  experts.gate_up_proj[e]).chunk(2, dim=-1)
            h = q8_0_rounded(experts.act_fn(gate) * up, order(e, "down"))
            y = torch.nn.functional.linear(h, experts.down_proj[e]) * top_k_weights[tokens, slots, None]
            out.index_add_(0, tokens, y)
        return out
    return forward
