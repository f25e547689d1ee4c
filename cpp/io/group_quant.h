// What GPTQ and AWQ checkpoints share once unpacked: per-group integer codes with a zero and an
// f16 scale per (output, group), w = s * (q - z). store_as_blocks turns a module's codes into
// one `<module>.weight` of the GGUF block type that holds exactly those values:
//   4-bit, every zero 8:     Q4_0, w = s * (q - 8)
//   4-bit, other zeros:      Q5_0, w = s * ((q - z + 16) - 16)
//   8-bit, every zero 128:   Q8_0, w = s * (q - 128)
//   8-bit, other zeros:      Q8_0, w = s * (q - 128) + s * (128 - z), the second term as the
//                            tensor's group_offsets (q - z does not fit 8 bits)
// A group is whole 32-column blocks, each block taking its group's scale as its own.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "io/weight_source.h"
#include <nlohmann/json.hpp>

namespace ferrum {

struct GroupCodes {
  int bits = 4;
  int64_t N = 0, K = 0;        // outputs, inputs
  int64_t group_size = 0;      // inputs per group (K for one group per row)
  std::vector<uint8_t> q;      // [N, K]
  std::vector<uint8_t> zeros;  // [N, G]
  std::vector<uint16_t> scales;  // [N, G], f16 bits
  // Act-order: q's columns hold the inputs in this order, grouped (each group's inputs together,
  // a whole number of 32-column blocks), and block_groups[b] is block b's group. Empty: inputs in
  // order, block b in group b * 32 / group_size.
  std::vector<int32_t> input_order, block_groups;
  int64_t groups() const { return (K + group_size - 1) / group_size; }
  int64_t block_group(int64_t b) const { return block_groups.empty() ? b * 32 / group_size : block_groups[size_t(b)]; }
};

// Act-order: the order that groups a module's inputs by g_idx (each group's inputs in their
// order) into codes.input_order / block_groups, and q's columns permuted into it. ValueError
// (naming `tensor`) when a group does not hold a whole number of 32-input blocks.
void group_inputs(GroupCodes& codes, const std::vector<int32_t>& g_idx, const std::string& where,
                  const std::string& tensor);

// Replaces the module's packed tensors (those of `packed_suffixes` present) with
// `<module>.weight`; `method` says whose codes they are, in names.
void store_as_blocks(WeightSource& ws, const std::string& module, const GroupCodes& c, const char* method,
                     const std::vector<std::string>& packed_suffixes);

// The tensor `name` as a packed tensor must be: present, of dtype `dtype` and shape `shape`
// (ValueError "<path>: <method> tensor '<name>' ..." otherwise; `why` explains the shape).
const TensorInfo& packed_tensor(const WeightSource& ws, const std::string& name, DType dtype, const Shape& shape,
                                const std::string& why, const char* method);

uint32_t packed_word(const TensorInfo& t, int64_t i);

// quantization_config fields: absent or null gives the fallback, another JSON type a ValueError
// naming `where` and the key.
const nlohmann::json* config_field(const nlohmann::json& q, const char* key);
int64_t config_int(const nlohmann::json& q, const char* key, int64_t fallback, const std::string& where);
std::string config_string(const nlohmann::json& q, const char* key, const std::string& fallback,
                          const std::string& where);
bool config_bool(const nlohmann::json& q, const char* key, bool fallback, const std::string& where);

}  // namespace ferrum
