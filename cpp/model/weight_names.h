// The tensors a decoder reads, named as HF and GGUF checkpoints name them (one table), and the
// structure rule every weight file meets before any of it is loaded.
#pragma once
#include <string>

#include "io/weight_source.h"
#include "model/config.h"

namespace ferrum {

enum class Naming { HF, GGUF };

// {} is the layer index, {e} the expert index.
struct NamePair { const char* hf; const char* gguf; };
extern const NamePair kEmbed, kFinalNorm, kLmHead, kAttnNorm, kFfnNorm, kQ, kK, kV, kQBias, kKBias, kVBias, kO,
    kQNorm, kKNorm, kGate, kUp, kDown, kRouter, kGateExps, kUpExps, kDownExps;
// GGUF only: Llama-3 rope scaling stored as per-frequency divisors [head_dim / 2].
extern const char* const kRopeFreqs;

Naming naming_of(const WeightSource& src);
std::string tensor_name(const NamePair& p, Naming naming, int64_t layer = -1, int64_t expert = -1);

// Refuses (FormatError naming the file and the tensor) weights that do not match cfg: a tensor
// the model reads is missing, has another shape, or has a type that cannot serve its role (an
// integer matrix, a quantized norm); or a tensor is there that the model does not read (a layer
// past block_count, an expert past expert_count, a stray name; llama.cpp refuses those too). HF
// checkpoints may also hold lm_head.weight beside tied embeddings and rotary_emb.inv_freq.
void check_weights(const WeightSource& src, const ModelConfig& cfg);

}  // namespace ferrum
