#include "quant/kernels.h"
namespace ferrum::quant::detail {
DotRowsFn avx512_dot_rows(DType) { return nullptr; }
}
