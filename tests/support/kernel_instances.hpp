// The attention kernels of the built-in element types are compiled once per test executable
// flavour, in tests/support/kernel_instances.cpp (the kvcache_test_kernels_<flavour> object
// library, tests/CMakeLists.txt), not in every test unit that runs attention: each unit
// compiled them again, for f32, f16, bf16, q8_0 and q4_0 (kvcache/ops/instances.hpp).
// Included by the precompiled header; without it (KVCACHE_TEST_PCH=OFF) each unit compiles
// the kernels itself and links as before.
#pragma once

#include <kvcache/kvcache.hpp>

KVCACHE_EXTERN_ATTENTION(kvcache::f32)
KVCACHE_EXTERN_ATTENTION(kvcache::f16)
KVCACHE_EXTERN_ATTENTION(kvcache::bf16)
KVCACHE_EXTERN_ATTENTION(kvcache::q8_0)
KVCACHE_EXTERN_ATTENTION(kvcache::q4_0)
