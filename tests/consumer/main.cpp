// Builds against the installed package and uses the cache once.
#include <kvcache/kvcache.hpp>

#include <cstdio>
#include <vector>

int main() {
    kvcache::model_shape shape;
    shape.n_layer = 2;
    shape.n_head_kv = 2;
    shape.head_dim_k = 8;
    shape.n_cells = 64;
    kvcache::kv_cache<kvcache::f16> cache(shape);
    const std::vector<kvcache::pos_t> pos{0, 1, 2};
    const std::vector<kvcache::seq_id_t> seq{0, 0, 0};
    kvcache::transaction tx(cache);
    auto placed = cache.place(pos, seq);
    if (!placed) return 1;
    tx.commit();
    std::printf("consumer: %u cells used, %zu bytes per token\n", cache.used(), cache.bytes_per_token());
    return cache.used() == 3 ? 0 : 1;
}
