// expect: kvcache: slot_manager<Cache> needs a kvcache::memory
#include <kvcache/kvcache.hpp>

struct not_a_cache {};

int main() {
    not_a_cache c;
    kvcache::slot_manager<not_a_cache, int> slots(c, {});
    return 0;
}
