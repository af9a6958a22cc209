// expect: more than one element policy
// Two policies of the same kind are rejected.
#include <kvcache/kvcache.hpp>

int main() {
    kvcache::model_shape s;
    kvcache::kv_cache<kvcache::f16, kvcache::f32> cache(s);
    return 0;
}
