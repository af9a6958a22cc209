// expect: kvcache: (io|ops)::[a-z_]+ needs a kvcache::memory
// Passing something that is not a memory (an int, a struct) to an entry point fails with
// a first error line that names the concept.
#include <kvcache/kvcache.hpp>

struct not_a_cache {
    int n_cells = 0;
};

int main() {
    not_a_cache c;
    auto bytes = kvcache::io::save_state(c);
    int i = 0;
    kvcache::ops::context_shift(i, 0, 0);
    return static_cast<int>(bytes.size());
}
