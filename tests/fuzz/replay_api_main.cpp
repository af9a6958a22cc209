// test_fuzz_api_replay: runs every file under the given directories (default: the API
// seed corpus next to this file, regression inputs included) through the API fuzz
// harness. Built with the project's compiler, so it runs in every CI build.
#include "support/fault_alloc.hpp"  // replaces operator new: only in this translation unit

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "api_harness.hpp"

int main(int argc, char** argv) {
    namespace fs = std::filesystem;
    std::vector<fs::path> dirs;
    for (int i = 1; i < argc; ++i) dirs.emplace_back(argv[i]);
    if (dirs.empty()) dirs = {KVFUZZ_DIR "/api_corpus"};
    std::size_t n = 0;
    for (const auto& d : dirs) {
        if (!fs::is_directory(d)) {
            std::fprintf(stderr, "test_fuzz_api_replay: %s is not a directory\n", d.c_str());
            return 1;
        }
        std::vector<fs::path> files;
        for (const auto& e : fs::recursive_directory_iterator(d))
            if (e.is_regular_file() && e.path().extension() != ".md") files.push_back(e.path());
        std::sort(files.begin(), files.end());
        for (const auto& f : files) {
            std::ifstream in(f, std::ios::binary);
            const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
            kvapi::run_one(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
            ++n;
        }
    }
    const auto& s = kvapi::stats;
    std::printf("test_fuzz_api_replay: %zu inputs, %llu operations (%llu accepted, %llu refused, %llu injected "
                "allocation failures, %llu paged loads refused for blocks), no finding\n",
                n, static_cast<unsigned long long>(s.ops), static_cast<unsigned long long>(s.accepted),
                static_cast<unsigned long long>(s.refused), static_cast<unsigned long long>(s.alloc_failures),
                static_cast<unsigned long long>(s.paged_load_no_space));
    // The corpus must reach every kind of outcome, or it has stopped testing something.
    return n > 0 && s.accepted > 0 && s.refused > 0 && s.alloc_failures > 0 ? 0 : 1;
}
