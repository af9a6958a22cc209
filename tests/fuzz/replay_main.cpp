// test_fuzz_replay: runs every file under the given directories (default: the seed
// corpus and the regression inputs next to this file) through the fuzz harness.
// Built with the project's compiler, so it runs in every CI build, sanitizers included.
// With the default directories it also fails when the seeds never reach the accepted
// path of the recurrent or the hybrid target (fuzz_harness_rec.hpp).
#include <cstdio>

#include "fuzz_harness_rec.hpp"
#include "replay_dirs.hpp"

int main(int argc, char** argv) {
    const long n = kvfuzz_replay::replay_dirs(argc, argv, {KVFUZZ_DIR "/corpus", KVFUZZ_DIR "/regressions"},
                                              "test_fuzz_replay", kvfuzz::run_one_all);
    if (n < 0) return 1;
    if (argc == 1 && (kvfuzz::rec_accepted[0] == 0 || kvfuzz::rec_accepted[1] == 0)) {
        std::fprintf(stderr, "test_fuzz_replay: the seeds reach no accepted recurrent (%ld) or hybrid (%ld) state\n",
                     kvfuzz::rec_accepted[0], kvfuzz::rec_accepted[1]);
        return 1;
    }
    std::printf("test_fuzz_replay: %ld inputs, no finding (accepted: %ld recurrent, %ld hybrid loads)\n", n,
                kvfuzz::rec_accepted[0], kvfuzz::rec_accepted[1]);
    return n > 0 ? 0 : 1;
}
