// kvcache: umbrella header. Includes the whole public API.
//
//   concepts.hpp        policy kinds (element, layout, reuse) as concepts
//   kv_cache.hpp        kv_cache<Policies...>, placement, transactions, sequence ops
//   model_shape.hpp     model shape, RoPE parameters, validation
//   cells/              per-cell metadata (positions, sequence sets, shifts) and indexes
//   element/            f32, f16, bf16 element policies
//   layout/             K/V storage arrangements (contiguous, paged, ring) and the ISWA cache
//   reuse/              reuse strategies across requests
//   simd/               arch-specific helpers (f16/bf16 conversion)
#pragma once

#include "config.hpp"
#include "error.hpp"
#include "concepts.hpp"
#include "model_shape.hpp"
#include "cells/seq_set.hpp"
#include "cells/cell_table.hpp"
#include "element/f32.hpp"
#include "element/f16.hpp"
#include "element/bf16.hpp"
#include "layout/kv_storage.hpp"
#include "layout/contiguous.hpp"
#include "layout/paged.hpp"
#include "layout/ring.hpp"
#include "reuse/none.hpp"
#include "kv_cache.hpp"
#include "layout/iswa.hpp"
#include "io/state.hpp"
#include "ops/rope.hpp"
#include "ops/kshift.hpp"
#include "ops/attention.hpp"
#include "ops/defrag.hpp"
#include "ops/memory.hpp"
#include "ops/context_shift.hpp"
#include "prompt/prompt_tokens.hpp"
#include "prompt/radix_index.hpp"
#include "prompt/entry_store.hpp"
#include "prompt/prompt_cache.hpp"
#include "prompt/slots.hpp"
#include "reuse/plan.hpp"
#include "reuse/lcp.hpp"
#include "reuse/chunk_shift.hpp"
#include "reuse/eviction.hpp"
#include "reuse/global.hpp"
