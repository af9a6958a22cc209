// expect: every policy must declare `using policy_kind
// A type that does not name its policy kind is rejected with a readable message.
#include <kvcache/kvcache.hpp>

struct not_a_policy {};

int main() {
    kvcache::model_shape s;
    kvcache::kv_cache<not_a_policy> cache(s);
    return 0;
}
