// A user-written element policy: K/V stored as 16-bit fixed point (Q-format with a
// fixed power-of-two scale), saturating. It plugs into kv_cache<...> like the
// built-in f32/f16/bf16 because it satisfies kvcache::element_policy.
#include <kvcache/kvcache.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

/// Values in [-2^(15-FracBits), 2^(15-FracBits)) with 2^-FracBits resolution.
template <int FracBits>
struct fixed16 {
    // Required members (see kvcache/concepts.hpp, "Element policy"):
    using policy_kind = kvcache::element_tag;                // 1. opt in to the element kind
    static constexpr std::string_view name = "fixed16";     // 2. a name
    static constexpr std::uint32_t type_id = 0x1000 + FracBits;  // 3. a stable id for state files
    using storage_type = std::int16_t;                       // 4. what the cache stores

    static void to_float(const std::int16_t* src, float* dst, std::size_t n) noexcept {  // 5.
        for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * (1.0f / (1 << FracBits));
    }
    static void from_float(const float* src, std::int16_t* dst, std::size_t n) noexcept {  // 6.
        for (std::size_t i = 0; i < n; ++i) {
            const float scaled = std::nearbyint(src[i] * (1 << FracBits));
            dst[i] = static_cast<std::int16_t>(std::clamp(scaled, -32768.0f, 32767.0f));
        }
    }
};

static_assert(kvcache::element_policy<fixed16<8>>);

int main() {
    kvcache::model_shape shape;
    shape.n_layer = 2;
    shape.n_head_kv = 1;
    shape.head_dim_k = 4;
    shape.n_cells = 16;
    kvcache::kv_cache<fixed16<8>> cache(shape);  // layout and reuse keep their defaults

    const std::vector<kvcache::pos_t> pos{0, 1};
    const std::vector<kvcache::seq_id_t> seq{0, 0};
    const std::vector<float> k{0.5f, -1.25f, 3.0f, 100.0f, 1.0f, 0.25f, -0.5f, 2.0f};
    const std::vector<float> v{1.0f, 2.0f, 3.0f, 4.0f, -1.0f, 0.5f, 0.0f, 8.0f};
    kvcache::transaction tx(cache);
    const auto cells = cache.place(pos, seq).value().cells;
    for (std::uint32_t layer = 0; layer < shape.n_layer; ++layer) {
        cache.write_k(layer, cells, k.data());
        cache.write_v(layer, cells, v.data());
    }
    tx.commit();

    std::vector<float> back(4);
    cache.read_k(0, cells[0], back.data());
    std::printf("%s: K row read back as %.3f %.3f %.3f %.3f (%zu bytes per token)\n",
                std::string(fixed16<8>::name).c_str(), back[0], back[1], back[2], back[3], cache.bytes_per_token());
    bool ok = back[0] == 0.5f && back[1] == -1.25f && back[2] == 3.0f && back[3] == 100.0f;

    // Attention reads fixed16 through to_float (the kernels' generic path): a query at
    // position 1 sees both tokens; the result is their softmax-weighted V rows.
    const std::vector<float> q{0.1f, 0.2f, -0.3f, 0.01f};
    const kvcache::pos_t q_pos = 1;
    const kvcache::seq_id_t q_seq = 0;
    kvcache::ops::attention_params p;
    p.n_head = 2;  // two query heads share the KV head (GQA)
    std::vector<float> qq(q);
    qq.insert(qq.end(), q.begin(), q.end());
    std::vector<float> out(2 * 4);
    kvcache::ops::attention_workspace ws;
    kvcache::ops::attention(cache, 0, qq.data(), &q_pos, &q_seq, 1, p, out.data(), ws);
    double s0 = 0.0, s1 = 0.0;
    for (int d = 0; d < 4; ++d) {
        s0 += q[d] * k[d];
        s1 += q[d] * k[4 + d];
    }
    const double w0 = 1.0 / (1.0 + std::exp((s1 - s0) / 2.0));  // scale 1/sqrt(4)
    for (int h = 0; h < 2; ++h)
        for (int d = 0; d < 4; ++d) {
            const double want = w0 * v[d] + (1.0 - w0) * v[4 + d];
            ok = ok && std::abs(out[h * 4 + d] - want) < 1e-2;
        }
    std::printf("attention: %.3f %.3f %.3f %.3f\n", out[0], out[1], out[2], out[3]);

    // The K-shift rotates fixed16 K through to_float / from_float: moving the sequence by
    // +5 and back by -5 returns each K value to within two fixed16 steps (2 / 256).
    cache.seq_add(0, 0, -1, 5).value();
    kvcache::ops::apply_k_shift(cache);
    cache.seq_add(0, 0, -1, -5).value();
    kvcache::ops::apply_k_shift(cache);
    cache.read_k(0, cells[1], back.data());
    for (int d = 0; d < 4; ++d) ok = ok && std::abs(back[d] - k[4 + d]) <= 2.0f / 256.0f;
    std::printf("K after +5 and -5: %.3f %.3f %.3f %.3f\n", back[0], back[1], back[2], back[3]);
    return ok ? 0 : 1;
}
