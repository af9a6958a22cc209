// test_fuzz_api_replay: runs every file under the given directories (default: the API
// seed corpus next to this file, regression inputs included) through the API fuzz
// harness. Built with the project's compiler, so it runs in every CI build.
#include "support/fault_alloc.hpp"  // replaces operator new: only in this translation unit

#include <cstdio>

#include "api_harness.hpp"
#include "replay_dirs.hpp"

int main(int argc, char** argv) {
    const long n = kvfuzz_replay::replay_dirs(argc, argv, {KVFUZZ_DIR "/api_corpus"}, "test_fuzz_api_replay",
                                              kvapi::run_one);
    if (n < 0) return 1;
    const auto& s = kvapi::stats;
    std::printf("test_fuzz_api_replay: %ld inputs, %llu operations (%llu accepted, %llu refused, %llu injected "
                "allocation failures, %llu paged loads refused for blocks), no finding\n",
                n, static_cast<unsigned long long>(s.ops), static_cast<unsigned long long>(s.accepted),
                static_cast<unsigned long long>(s.refused), static_cast<unsigned long long>(s.alloc_failures),
                static_cast<unsigned long long>(s.paged_load_no_space));
    // The corpus must reach every kind of outcome, or it has stopped testing something.
    return n > 0 && s.accepted > 0 && s.refused > 0 && s.alloc_failures > 0 ? 0 : 1;
}
