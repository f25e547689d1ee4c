// Helpers every program includes first. OpenCL C 1.2 without cl_khr_fp16: f16 data is only
// touched through vload_half / vstore_half, which are core functions.

// Tensors arrive as (buffer, offset) pairs: offsets are in elements of the pointer's type, so
// one cl_mem can back many views (weight slices, reshaped activations) without sub-buffers.
#define AT(p, off) ((p) + (off))

// For helpers called in several places of a hot loop, which LLVM otherwise leaves as calls
// (passing accumulators through memory).
#define ALWAYS_INLINE static inline __attribute__((always_inline))
// Helpers are `static inline`: a plain C99 `inline` function that a compiler chooses not to
// inline is an unresolved external (NVIDIA's ptxas refuses the program).

static inline float bf16_to_f32(ushort u) { return as_float(((uint)u) << 16); }

static inline float sum8(float8 a) {
  float4 b = a.lo + a.hi;
  float2 c = b.lo + b.hi;
  return c.x + c.y;
}

static inline float sum16(float16 v) { return sum8(v.lo + v.hi); }

// The i-quants' non-linear 4-bit levels (cpp/quant/formats.h: kIq4Values), looked up with
// shuffle(IQ4_LEVELS, nibbles).
#define IQ4_LEVELS (char16)(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
