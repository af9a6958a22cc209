// The README's usage example: build a cache, place a batch inside a transaction,
// write K/V for every layer, commit, then use sequence operations.
#include <kvcache/kvcache.hpp>

#include <cstdio>
#include <vector>

int main() {
    // 1. Describe the model: 4 layers, 2 KV heads of 64 dims, room for 4096 tokens.
    kvcache::model_shape shape;
    shape.n_layer = 4;
    shape.n_head_kv = 2;
    shape.head_dim_k = 64;
    shape.rope = {kvcache::rope_type::neox, 10000.0f, 1.0f, 0};
    shape.n_cells = 4096;
    shape.n_seq_max = 2;

    // 2. Pick policies (any order; kinds left out get defaults).
    using cache_t = kvcache::kv_cache<kvcache::f16, kvcache::contiguous<>>;
    cache_t cache(shape);
    std::printf("%zu bytes per token, %zu bytes reserved\n", cache.bytes_per_token(), cache.total_bytes());

    // 3. Place an 8-token prompt of sequence 0, write K/V per layer, commit.
    std::vector<kvcache::pos_t> pos{0, 1, 2, 3, 4, 5, 6, 7};
    std::vector<kvcache::seq_id_t> seq(pos.size(), 0);
    std::vector<float> k(pos.size() * shape.k_row_size(), 0.5f), v(pos.size() * shape.v_row_size(), 0.25f);
    {
        kvcache::transaction tx(cache);  // restores the cells unless committed
        auto placed = cache.place(pos, seq);
        if (!placed) {
            std::printf("no room: %s\n", placed.message().c_str());
            return 1;
        }
        for (std::uint32_t layer = 0; layer < shape.n_layer; ++layer) {
            cache.write_k(layer, placed.value().cells, k.data());
            cache.write_v(layer, placed.value().cells, v.data());
            // ... attention for this layer reads the cache here ...
        }
        tx.commit();
    }

    // 4. Sequence operations: share the prompt with sequence 1, drop its last 2 tokens.
    cache.seq_cp(0, 1, 0, -1);
    cache.seq_rm(1, 6, -1);
    std::printf("seq 0: [%d, %d], seq 1: [%d, %d], %u cells used\n", cache.seq_pos_min(0), cache.seq_pos_max(0),
                cache.seq_pos_min(1), cache.seq_pos_max(1), cache.used());

    // 5. Bad input is an exception naming the problem; the cache is unchanged.
    try {
        cache.seq_rm(7, 0, -1);
    } catch (const kvcache::error& e) {
        std::printf("refused: %s\n", e.what());
    }
    return cache.used() == 8 ? 0 : 1;
}
