// The attention kernels of the built-in element types are compiled once per test executable
// flavour, in tests/support/kernel_instances.cpp (the kvcache_test_kernels_<flavour> object
// library, tests/CMakeLists.txt), not in every test unit that runs attention: each unit
// compiled them again, for f32, f16, bf16, q8_0 and q4_0 (kvcache/ops/instances.hpp).
// Included by the precompiled header; without it (KVCACHE_TEST_PCH=OFF) each unit compiles
// the kernels itself and links as before.
#pragma once

#include <kvcache/kvcache.hpp>

/// The element types whose kernels the tests share: X(Element) for each.
#define KVTEST_SHARED_KERNEL_ELEMENTS(X) X(kvcache::f32) X(kvcache::f16) X(kvcache::bf16) X(kvcache::q8_0) X(kvcache::q4_0)

KVTEST_SHARED_KERNEL_ELEMENTS(KVCACHE_EXTERN_ATTENTION)
