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

    const std::vector<kvcache::pos_t> pos{0};
    const std::vector<kvcache::seq_id_t> seq{0};
    const std::vector<float> k{0.5f, -1.25f, 3.0f, 100.0f}, v{1.0f, 2.0f, 3.0f, 4.0f};
    kvcache::transaction tx(cache);
    const auto cells = cache.place(pos, seq).value().cells;
    cache.write_k(0, cells, k.data());
    cache.write_v(0, cells, v.data());
    tx.commit();

    std::vector<float> back(4);
    cache.read_k(0, cells[0], back.data());
    std::printf("%s: K row read back as %.3f %.3f %.3f %.3f (%zu bytes per token)\n",
                std::string(fixed16<8>::name).c_str(), back[0], back[1], back[2], back[3], cache.bytes_per_token());
    return back[0] == 0.5f && back[1] == -1.25f && back[2] == 3.0f && back[3] == 100.0f ? 0 : 1;
}
