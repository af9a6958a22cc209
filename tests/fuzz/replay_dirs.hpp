// The replay loop both replay executables share: every regular file (but *.md) under the
// given directories, in sorted order, is read whole and passed to run_one.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

namespace kvfuzz_replay {

/// Replays the directories named on the command line (else `defaults`); returns the
/// number of inputs run, or -1 (message on stderr, prefixed by `name`) when one is not a
/// directory.
template <class RunOne>
long replay_dirs(int argc, char** argv, std::vector<std::filesystem::path> defaults, const char* name,
                 RunOne run_one) {
    namespace fs = std::filesystem;
    std::vector<fs::path> dirs;
    for (int i = 1; i < argc; ++i) dirs.emplace_back(argv[i]);
    if (dirs.empty()) dirs = std::move(defaults);
    long n = 0;
    for (const auto& d : dirs) {
        if (!fs::is_directory(d)) {
            std::fprintf(stderr, "%s: %s is not a directory\n", name, d.c_str());
            return -1;
        }
        std::vector<fs::path> files;
        for (const auto& e : fs::recursive_directory_iterator(d))
            if (e.is_regular_file() && e.path().extension() != ".md") files.push_back(e.path());
        std::sort(files.begin(), files.end());
        for (const auto& f : files) {
            std::ifstream in(f, std::ios::binary);
            const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
            run_one(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
            ++n;
        }
    }
    return n;
}

}  // namespace kvfuzz_replay
