// kvcache ops: explicit instantiation of the attention kernels, so that a program compiles
// them once instead of once per translation unit.
//
// ops::attention and ops::attention_plan run kernels that are templates over the element
// type, the slot count of a work item and the summation order (ten kernels per element,
// plus the scalar path). Every translation unit that calls them for an element compiles all
// of them again, and under optimisation they are most of such a unit's compile time (tests/
// kernels/test_attention.cpp, Clang 14 -O1 with ASan + UBSan: 52% of the optimiser's time
// went to kernels::attention_kernel). A program with several such units can compile them in
// one:
//
//     // kernels.cpp, one unit of the program:
//     #include <kvcache/ops/instances.hpp>
//     KVCACHE_INSTANTIATE_ATTENTION(kvcache::f16)
//
//     // every other unit that runs attention on f16 caches, before its first call
//     // (a header of the program that they all include):
//     #include <kvcache/ops/instances.hpp>
//     KVCACHE_EXTERN_ATTENTION(kvcache::f16)
//
// Any element type works (custom ones too). The units must be compiled with the same
// instruction-set flags, as kvcache requires anyway: the kernels live in a namespace named
// after them (config.hpp, KVCACHE_ABI_NAMESPACE), so a mismatch fails to link rather than
// mixing code for different CPUs. The ops code that plans a call (per cache type) stays in
// each unit; only the kernels move.
#pragma once

#include <cstddef>  // std::size_t

#include "../config.hpp"
#include "attention.hpp"

/// Shared body of the two macros below: `ext` is `extern` or nothing.
#define KVCACHE_DETAIL_ATTENTION_INSTANCES(ext, ...)                                                                 \
    ext template void ::kvcache::ops::detail_attn::run_one_item<__VA_ARGS__, false>(                                  \
        const ::kvcache::ops::detail_attn::call_items<typename __VA_ARGS__::storage_type>&, std::size_t,            \
        float*) noexcept;                                                                                            \
    ext template void ::kvcache::ops::detail_attn::run_one_item<__VA_ARGS__, true>(                                   \
        const ::kvcache::ops::detail_attn::call_items<typename __VA_ARGS__::storage_type>&, std::size_t,            \
        float*) noexcept;                                                                                            \
    ext template void ::kvcache::kernels::attention_scalar<__VA_ARGS__, ::kvcache::ops::detail_attn::cell_seqs>(      \
        const ::kvcache::kv_layer_view<const typename __VA_ARGS__::storage_type>&,                                   \
        const ::kvcache::kernels::scalar_attn_args<::kvcache::ops::detail_attn::cell_seqs>&, float*) noexcept;

/// Compiles the attention kernels of element type `Element` in this unit (at namespace
/// scope, once per program and instruction-set flavour).
#define KVCACHE_INSTANTIATE_ATTENTION(...) KVCACHE_DETAIL_ATTENTION_INSTANCES(, __VA_ARGS__)

/// Declares that another unit of the program compiles the attention kernels of element
/// type `Element` (KVCACHE_INSTANTIATE_ATTENTION): this unit calls them and does not compile
/// them. At namespace scope, before the unit's first ops::attention call on that element.
#define KVCACHE_EXTERN_ATTENTION(...) KVCACHE_DETAIL_ATTENTION_INSTANCES(extern, __VA_ARGS__)
