// libFuzzer entry point for the state loader (clang, -fsanitize=fuzzer,address,undefined).
// See fuzz_harness.hpp (K/V states) and fuzz_harness_rec.hpp (recurrent and hybrid
// states, routed by their magic) for what each input goes through and run_fuzz.sh for
// how to run it.
#include "fuzz_harness_rec.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    return kvfuzz::run_one_all(data, size);
}
