// test_fuzz_replay: runs every file under the given directories (default: the seed
// corpus and the regression inputs next to this file) through the fuzz harness.
// Built with the project's compiler, so it runs in every CI build, sanitizers included.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz_harness.hpp"

int main(int argc, char** argv) {
    namespace fs = std::filesystem;
    std::vector<fs::path> dirs;
    for (int i = 1; i < argc; ++i) dirs.emplace_back(argv[i]);
    if (dirs.empty()) dirs = {KVFUZZ_DIR "/corpus", KVFUZZ_DIR "/regressions"};
    std::size_t n = 0;
    for (const auto& d : dirs) {
        if (!fs::is_directory(d)) {
            std::fprintf(stderr, "test_fuzz_replay: %s is not a directory\n", d.c_str());
            return 1;
        }
        std::vector<fs::path> files;
        for (const auto& e : fs::recursive_directory_iterator(d))
            if (e.is_regular_file() && e.path().extension() != ".md") files.push_back(e.path());
        std::sort(files.begin(), files.end());
        for (const auto& f : files) {
            std::ifstream in(f, std::ios::binary);
            const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
            kvfuzz::run_one(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
            ++n;
        }
    }
    std::printf("test_fuzz_replay: %zu inputs, no finding\n", n);
    return n > 0 ? 0 : 1;
}
