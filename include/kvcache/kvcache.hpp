// kvcache: umbrella header. Includes the whole public API, layer by layer; a folder
// includes only folders above it in this list (tests/headers checks each header alone).
//
//   config.hpp error.hpp model_shape.hpp concepts.hpp detail/
//                       basics: macros, errors, shapes, positions, policy tags and concepts
//   tokens/             token ids, media chunks, prompt_tokens (what reuse plans compare)
//   simd/               arch-specific helpers (f16/bf16 conversion, tile loads)
//   element/            f32, f16, bf16, q8_0, q4_0 element policies
//   format/             the physical K/V format (tiles, V blocks, views) layouts write and
//                       kernels and state files read
//   cells/              per-cell metadata (positions, sequence sets, shifts) and indexes
//   layout/             layout policies: where K/V live and how cells are placed
//   reuse/              reuse policies and their plans over token lists
//   memory/             the memory contract; kv_cache<Policies...>, iswa_cache, recurrent_memory, hybrid_memory
//   kernels/            SIMD + OpenMP kernels over format views and spans
//   ops/                public operations on a memory (attention, K-shift, defrag, context shift)
//   io/                 state files (save / load whole caches or one sequence)
//   prompt/             slots, the global prompt cache, the radix index
#pragma once

#include "config.hpp"
#include "error.hpp"
#include "concepts.hpp"
#include "model_shape.hpp"
#include "tokens/token.hpp"
#include "tokens/prompt_tokens.hpp"
#include "element/f32.hpp"
#include "element/f16.hpp"
#include "element/bf16.hpp"
#include "element/q4_0.hpp"
#include "element/q8_0.hpp"
#include "format/kv_view.hpp"
#include "cells/seq_set.hpp"
#include "cells/cell_table.hpp"
#include "cells/seq_step.hpp"
#include "layout/kv_storage.hpp"
#include "layout/contiguous.hpp"
#include "layout/paged.hpp"
#include "layout/ring.hpp"
#include "reuse/none.hpp"
#include "reuse/lcp.hpp"
#include "reuse/chunk_shift.hpp"
#include "reuse/eviction.hpp"
#include "reuse/global.hpp"
#include "reuse/plan.hpp"
#include "memory/memory.hpp"
#include "memory/kv_cache.hpp"
#include "memory/iswa_cache.hpp"
#include "memory/recurrent.hpp"
#include "memory/hybrid.hpp"
#include "ops/rope.hpp"
#include "ops/kshift.hpp"
#include "ops/attention.hpp"
#include "ops/instances.hpp"
#include "ops/defrag.hpp"
#include "ops/memory.hpp"
#include "ops/context_shift.hpp"
#include "ops/hybrid.hpp"
#include "io/state.hpp"
#include "io/recurrent.hpp"
#include "io/hybrid.hpp"
#include "tier/sha256.hpp"
#include "tier/key.hpp"
#include "tier/blob.hpp"
#include "tier/tier.hpp"
#include "tier/tier_cache.hpp"
#include "prompt/radix_index.hpp"
#include "prompt/entry_store.hpp"
#include "prompt/prompt_cache.hpp"
#include "prompt/slots.hpp"
