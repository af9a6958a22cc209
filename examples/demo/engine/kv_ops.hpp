// demo engine: the cache kernels the engine calls, all from the library (kvcache/ops/):
// RoPE on the host's Q and K rows, attention over the cache, and the K-shift that
// applies the position deltas recorded by seq_add / seq_div.
#pragma once

#include <kvcache/kvcache.hpp>
#include <kvcache/ops/attention.hpp>
#include <kvcache/ops/kshift.hpp>
#include <kvcache/ops/rope.hpp>

namespace demo::kv_ops {

using kvcache::ops::apply_k_shift;
using kvcache::ops::attention;
using kvcache::ops::attention_params;
using kvcache::ops::attention_workspace;
using kvcache::ops::rope_rows;

}  // namespace demo::kv_ops
