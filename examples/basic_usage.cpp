// The README's usage example: build a cache, place a batch inside a transaction,
// write K/V and run attention for every layer, commit, then use sequence operations.
#include <kvcache/kvcache.hpp>

#include <cstdio>
#include <vector>

int main() {
    // 1. Describe the model: 4 layers, 8 query heads sharing 2 KV heads of 64 dims, room for 4096 tokens.
    kvcache::model_shape shape;
    shape.n_layer = 4;
    shape.n_head_kv = 2;
    shape.head_dim_k = 64;
    shape.rope = {kvcache::rope_type::neox, 10000.0f, 1.0f, 0};
    shape.n_cells = 4096;
    shape.n_seq_max = 2;
    const std::uint32_t n_head = 8;

    // 2. Pick policies (any order; kinds left out get defaults).
    using cache_t = kvcache::kv_cache<kvcache::f16, kvcache::contiguous<>>;
    cache_t cache(shape);
    std::printf("%zu bytes per token, %zu bytes reserved\n", cache.bytes_per_token(), cache.total_bytes());

    // 3. One forward step for an 8-token prompt of sequence 0: place the batch, then per layer
    //    rotate Q and K (RoPE), write K/V into the placed cells, run attention; commit at the end.
    std::vector<kvcache::pos_t> pos{0, 1, 2, 3, 4, 5, 6, 7};
    std::vector<kvcache::seq_id_t> seq(pos.size(), 0);
    const auto n = static_cast<std::uint32_t>(pos.size());
    std::vector<float> q(n * n_head * shape.head_dim_k, 0.1f), out(n * n_head * shape.dim_v());
    std::vector<float> k(n * shape.k_row_size(), 0.5f), v(n * shape.v_row_size(), 0.25f);
    kvcache::ops::attention_workspace ws;  // reused across calls: no allocation once sized
    {
        kvcache::transaction tx(cache);  // restores the cells unless committed
        auto placed = cache.place(pos, seq);
        if (!placed) {
            std::printf("no room: %s\n", placed.message().c_str());
            return 1;
        }
        for (std::uint32_t layer = 0; layer < shape.n_layer; ++layer) {
            // (a real engine computes q, k, v from the layer's input here)
            kvcache::ops::rope_rows(q.data(), n, n_head, shape.head_dim_k, pos.data(), shape.rope);
            kvcache::ops::rope_rows(k.data(), n, shape.n_head_kv, shape.head_dim_k, pos.data(), shape.rope);
            cache.write_k(layer, placed.value().cells, k.data());
            cache.write_v(layer, placed.value().cells, v.data());
            kvcache::ops::attention(cache, layer, q.data(), pos.data(), seq.data(), n, {.n_head = n_head}, out.data(), ws);
        }
        tx.commit();
    }
    std::printf("attention output[0] = %.3f (V is 0.25 everywhere)\n", out[0]);

    // 4. Sequence operations: share the prompt with sequence 1, drop its last 2 tokens,
    //    move sequence 1 by +100 (its shared cells are split off) and apply the K-shift.
    cache.seq_cp(0, 1, 0, -1).value();
    cache.seq_rm(1, 6, -1).value();
    cache.seq_add(1, 0, -1, 100).value();
    kvcache::ops::apply_k_shift(cache);
    std::printf("seq 0: [%d, %d], seq 1: [%d, %d], %u cells used\n", cache.seq_pos_min(0), cache.seq_pos_max(0),
                cache.seq_pos_min(1), cache.seq_pos_max(1), cache.used());

    // 5. Bad input is an exception naming the problem; the cache is unchanged.
    try {
        cache.seq_rm(7, 0, -1).value();
    } catch (const kvcache::error& e) {
        std::printf("refused: %s\n", e.what());
    }
    return cache.used() == 14 && out[0] > 0.2499f && out[0] < 0.2501f ? 0 : 1;
}
