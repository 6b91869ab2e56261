// Every kernel one source file calls from another (the bindings in bindings.cpp, the decoder
// layer in decoder_layer.cpp): one declaration each, so their signatures cannot drift.
#pragma once

#include "torch_lite.h"

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

// rms_norm.cpp
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps, bool offset);

// gemm_bf16.cpp
torch::Tensor pack_bf16_gemm(torch::Tensor w);
bool gemm_bf16_vectorized();
std::string gemm_bf16_tiles();
void linear_bf16_packed(torch::Tensor out, torch::Tensor x, torch::Tensor packed, int64_t N,
                        c10::optional<torch::Tensor> bias, int64_t threads,
                        c10::optional<torch::Tensor> prefetch,
                        c10::optional<torch::Tensor> residual);
void linear_bf16_packed_gated(torch::Tensor out, torch::Tensor x, torch::Tensor packed,
                              int64_t N, c10::optional<torch::Tensor> bias, int64_t act,
                              int64_t threads, c10::optional<torch::Tensor> prefetch);
void linear_bf16_packed_on(torch::Tensor out, torch::Tensor x, torch::Tensor packed, int64_t N,
                           c10::optional<torch::Tensor> bias, int64_t threads,
                           const std::string& tiles, c10::optional<torch::Tensor> residual);
std::vector<std::string> gemm_bf16_families();
void gemm_bf16_select(const std::string& decode, const std::string& prefill, int64_t prefetch,
                      int64_t one_row_panels);
std::tuple<std::string, std::string, int64_t, bool, int64_t> gemm_bf16_selected();

// rope_kv.cpp
void rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t q_heads,
                   int64_t kv_heads, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slots);
bool rope_kv_vectorized();

// paged_attention.cpp
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                     torch::Tensor v_cache, torch::Tensor block_tables, torch::Tensor seq_info,
                     double scale, double softcap, int64_t window, int64_t threads);
void paged_attention_portable(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                              torch::Tensor v_cache, torch::Tensor block_tables,
                              torch::Tensor seq_info, double scale, double softcap,
                              int64_t window, int64_t threads);
bool paged_attention_avx2(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                          torch::Tensor v_cache, torch::Tensor block_tables,
                          torch::Tensor seq_info, double scale, double softcap, int64_t window,
                          int64_t threads);
int64_t paged_attention_lanes_width();
int64_t paged_attention_portable_width();

// gemv.cpp
void linear_bf16_small(torch::Tensor out, torch::Tensor x, torch::Tensor w,
                       c10::optional<torch::Tensor> bias, int64_t threads);
int64_t stream_pool_backoffs();

// linear_int8.cpp
void linear_int8(torch::Tensor out, torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                 c10::optional<torch::Tensor> bias, int64_t act,
                 c10::optional<torch::Tensor> residual, int64_t threads,
                 c10::optional<torch::Tensor> prefetch);
std::string linear_int8_family();

// lora.cpp
void lora_add(torch::Tensor out, torch::Tensor x, torch::Tensor a, torch::Tensor blocks,
              torch::Tensor meta, torch::Tensor rows);

// prefill_attention.cpp
void prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                       double scale, int64_t threads);
bool prefill_attention_ready();

