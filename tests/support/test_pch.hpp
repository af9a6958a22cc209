// Headers every test translation unit shares, precompiled once per instruction-set flavour
// (tests/CMakeLists.txt, KVCACHE_TEST_PCH): the library, doctest and the standard headers
// the tests use. Parsing them took several seconds per translation unit, about a third of
// the test suite's compile time. Tests still include what they use; with the PCH those
// includes cost nothing.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <kvcache/kvcache.hpp>

#include "kernel_instances.hpp"  // the attention kernels: compiled once per flavour
