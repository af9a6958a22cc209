// libFuzzer entry point for the state loader (clang, -fsanitize=fuzzer,address,undefined).
// See fuzz_harness.hpp for what each input goes through and run_fuzz.sh for how to run it.
#include "fuzz_harness.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    return kvfuzz::run_one(data, size);
}
