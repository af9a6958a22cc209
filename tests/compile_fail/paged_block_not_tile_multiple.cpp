// expect: BlockSize must be a positive multiple of 32
// A paged block must hold whole 32-cell K tiles: paged<16> is rejected at compile time.
#include <kvcache/kvcache.hpp>

int main() {
    kvcache::model_shape s;
    kvcache::kv_cache<kvcache::f16, kvcache::paged<16>> cache(s);
    return 0;
}
