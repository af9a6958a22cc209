// libFuzzer entry point for the API fuzzer (clang, -fsanitize=fuzzer,address,undefined):
// random operation sequences with allocation failures injected, checked against the
// reference model after every step. See api_harness.hpp; run with
// KVFUZZ_TARGET=api tests/fuzz/run_fuzz.sh.
#include "support/fault_alloc.hpp"  // replaces operator new: only in this translation unit

#include "api_harness.hpp"

// Linked with the libFuzzer runtime after this object (tests/fuzz/CMakeLists.txt), so that
// this object's exception-safe std::set<unsigned> node copier is the one the link keeps.
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    return kvapi::run_one(data, size);
}
