// kvcache tier: content-addressed keys of prompt-cache entries that leave the process
// (disk, Redis). A key names a block-aligned prefix of a prompt for one memory
// configuration and one tenant, and is reproducible across processes, machines and
// library versions (fixed encoding, SHA-256, versioned by key_version).
//
// Encoding (key_version 1; every integer 8 bytes little-endian, "||" = concatenation):
//   fp     = SHA-256("kvcache-tier-fp" || key_version || n_parts ||
//                    per part: n_layer, n_head_kv, head_dim_k, head_dim_v, type_id,
//                    elem_size, rope_type, n_rot, freq_base bits, freq_scale bits,
//                    layout_id, window, rope_ext)          (io/fingerprint.hpp fields)
//            (a memory with recurrent state appends, after its attention parts, the word
//            2^32 + n_layer, each layer's is_recurrent (hybrid_memory; none for
//            recurrent_memory, whose n_parts is 0), then the recurrent n_layer, d_conv,
//            d_inner, ssm_size)
//   seed   = SHA-256("kvcache-tier-key" || key_version || fp || salt || block_tokens)
//   k_0    = seed;  k_i = SHA-256(k_{i-1} || n_items || items of block i)
// Block i covers positions [i*B, (i+1)*B). Its items, in position order: a text token t as
// the word t (t >= 0), a media chunk beginning in the block as the two words
// (2^63 | n_pos) and id; positions inside a chunk add nothing more. k_i names the prefix of
// (i+1)*B positions, which exists only where no media chunk straddles that boundary.
#pragma once

#include <concepts>     // std::same_as
#include <cstddef>      // std::size_t
#include <cstdint>      // fixed-width integers
#include <string>       // hex
#include <type_traits>  // std::remove_cvref_t
#include <vector>       // key chains

#include "../error.hpp"
#include "../io/fingerprint.hpp"
#include "../memory/memory.hpp"
#include "../memory/recurrent.hpp"
#include "../tokens/prompt_tokens.hpp"
#include "sha256.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace tier {

/// Version of the key encoding above; a new encoding gets a new number (old keys then miss).
inline constexpr std::uint64_t key_version = 1;

/// The key of one entry: a SHA-256 digest.
struct key {
    sha256_digest digest{};
    /// 64 lower-case hex digits (file names, Redis keys).
    [[nodiscard]] std::string hex() const { return to_hex(digest); }
    friend bool operator==(const key&, const key&) = default;
};

/// Hash functor for unordered containers (the digest is uniform: its first 8 bytes).
struct key_hash {
    std::size_t operator()(const key& k) const noexcept {
        std::size_t h = 0;
        for (int i = 0; i < 8; ++i) h = (h << 8) | k.digest[static_cast<std::size_t>(i)];
        return h;
    }
};

/// A block-aligned prefix of a prompt and its key.
struct prefix_key {
    std::uint32_t n_tokens = 0;  ///< positions the key covers
    key k;
};

/// Digest of everything the K/V bytes of `mem` depend on besides the cells (shape, element
/// type, layout, window, RoPE variant; for a composite memory every part in order).
template <class Memory>
[[nodiscard]] sha256_digest memory_fingerprint(const Memory& mem) {
    static_assert(memory<Memory>, "kvcache: tier::memory_fingerprint needs a kvcache::memory");
    sha256 h;
    h.update(std::string_view("kvcache-tier-fp"));
    h.update_u64(key_version);
    auto part = [&](const auto& p) {
        const io::detail::fingerprint f = io::detail::fingerprint_of(p);
        for (std::uint32_t v : {f.n_layer, f.n_head_kv, f.head_dim_k, f.head_dim_v, f.type_id, f.elem_size, f.rope_type,
                                f.n_rot, f.freq_base_bits, f.freq_scale_bits, f.layout_id, f.window, f.rope_ext})
            h.update_u64(v);
    };
    auto attention = [&](const auto& a) {
        using A = std::remove_cvref_t<decltype(a)>;
        if constexpr (composite_memory<A>) {
            std::uint64_t n = 0;
            a.for_each_part([&](const auto&) { ++n; });
            h.update_u64(n);
            a.for_each_part(part);
        } else {
            h.update_u64(1);
            part(a);
        }
    };
    auto recurrent = [&](const recurrent_memory& r, std::uint32_t n_layer, auto is_recurrent) {
        h.update_u64((std::uint64_t{1} << 32) + n_layer);
        for (std::uint32_t l = 0; l < n_layer; ++l) h.update_u64(is_recurrent(l) ? 1 : 0);
        const recurrent_shape& rs = r.shape();
        for (std::uint32_t v : {rs.n_layer, rs.d_conv, rs.d_inner, rs.ssm_size}) h.update_u64(v);
    };
    if constexpr (std::same_as<Memory, recurrent_memory>) {
        h.update_u64(0);
        recurrent(mem, 0, [](std::uint32_t) { return true; });
    } else if constexpr (requires { mem.attention(); mem.recurrent(); mem.is_recurrent(0u); }) {  // hybrid_memory
        attention(mem.attention());
        recurrent(mem.recurrent(), mem.n_layer(), [&](std::uint32_t l) { return mem.is_recurrent(l); });
    } else {
        attention(mem);
    }
    return h.final();
}

/// Keys of every block-aligned prefix of `p` (block_tokens positions per block) up to
/// max_tokens positions, shortest first; boundaries that cut a media chunk are left out.
/// Throws invalid_argument for block_tokens = 0.
[[nodiscard]] inline std::vector<prefix_key> block_keys(const prompt_tokens& p, std::uint32_t block_tokens,
                                                        const sha256_digest& fingerprint, std::uint64_t salt,
                                                        std::size_t max_tokens = SIZE_MAX) {
    if (block_tokens == 0) kvcache::detail::fail(errc::invalid_argument, "tier::block_keys: block_tokens = 0, must be >= 1");
    sha256 h;
    h.update(std::string_view("kvcache-tier-key"));
    h.update_u64(key_version);
    h.update(fingerprint.data(), fingerprint.size());
    h.update_u64(salt);
    h.update_u64(block_tokens);
    sha256_digest prev = h.final();
    const std::size_t n = std::min(p.size(), max_tokens);
    const auto media = p.media();
    std::size_t m = 0;  // next media chunk
    std::vector<prefix_key> out;
    std::vector<std::uint64_t> items;
    for (std::size_t b0 = 0; b0 + block_tokens <= n; b0 += block_tokens) {
        const std::size_t b1 = b0 + block_tokens;
        items.clear();
        for (std::size_t i = b0; i < b1; ++i) {
            if (m < media.size() && media[m].begin == i) {
                items.push_back((std::uint64_t{1} << 63) | media[m].n_pos);
                items.push_back(media[m].id);
                i = std::uint64_t{media[m].begin} + media[m].n_pos - 1;  // skip the chunk (may leave the block)
                ++m;
                continue;
            }
            if (p[i] != null_token) items.push_back(static_cast<std::uint32_t>(p[i]));
        }
        h.reset();
        h.update(prev.data(), prev.size());
        h.update_u64(items.size());
        for (std::uint64_t v : items) h.update_u64(v);
        prev = h.final();
        // A chunk that began before b1 and ends after it makes b1 no prompt boundary.
        const bool cut = m > 0 && std::uint64_t{media[m - 1].begin} + media[m - 1].n_pos > b1;
        if (!cut) out.push_back(prefix_key{static_cast<std::uint32_t>(b1), key{prev}});
    }
    return out;
}

}  // namespace tier
KVCACHE_END_NAMESPACE
