#include "quant/kernels.h"
namespace ferrum::quant::detail {
DotRowsFn avx2_dot_rows(DType) { return nullptr; }
}
