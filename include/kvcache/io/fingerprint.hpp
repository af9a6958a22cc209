// kvcache io: what a state's bytes depend on besides its cells (the fingerprint of
// io/format.hpp, with the descriptor table parse.hpp checks it with), and the token list
// rules (F18) every save and load checks.
#pragma once

#include <cstddef>   // std::size_t
#include <cstdint>   // fixed-width integers
#include <cstdio>    // std::snprintf for hex values in messages
#include <cstring>   // std::memcpy
#include <optional>  // optional error messages
#include <span>      // token lists
#include <string>    // messages

#include "../detail/policy_select.hpp"
#include "../error.hpp"
#include "../layout/capabilities.hpp"
#include "../format/kv_view.hpp"
#include "../model_shape.hpp"
#include "../tokens/token.hpp"
#include "detail/xxhash.hpp"
#include "format.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace io {

namespace detail {

using kvcache::detail::internal_access;
using kvcache::detail::make_error;

inline std::string hex(std::uint64_t v) {
    char buf[24];
    std::snprintf(buf, sizeof(buf), "0x%016llx", static_cast<unsigned long long>(v));
    return buf;
}

/// The first problem of a token list with media chunks (F18 invariants), or nothing.
inline std::optional<std::string> check_tokens(std::span<const token_t> tokens, std::span<const media_chunk> media) {
    std::uint64_t next_free = 0;  // first position after the previous chunk
    for (std::size_t m = 0; m < media.size(); ++m) {
        const media_chunk& c = media[m];
        const std::string name = "media[" + std::to_string(m) + "]";
        const std::uint64_t end = std::uint64_t{c.begin} + c.n_pos;
        if (c.n_pos == 0) return name + ".n_pos = 0, must be >= 1";
        if (end > tokens.size())
            return name + " covers [" + std::to_string(c.begin) + ", " + std::to_string(end) + ") beyond the " +
                   std::to_string(tokens.size()) + " tokens";
        if (c.begin < next_free)
            return name + ".begin = " + std::to_string(c.begin) + " overlaps or precedes the previous chunk (ends at " +
                   std::to_string(next_free) + ")";
        next_free = end;
    }
    std::size_t m = 0;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
        while (m < media.size() && std::uint64_t{media[m].begin} + media[m].n_pos <= i) ++m;
        const bool covered = m < media.size() && media[m].begin <= i;
        if (covered && tokens[i] != null_token)
            return "token[" + std::to_string(i) + "] = " + std::to_string(tokens[i]) + " inside media[" +
                   std::to_string(m) + "], must be null_token";
        if (!covered && tokens[i] < 0)
            return "token[" + std::to_string(i) + "] = " + std::to_string(tokens[i]) +
                   (tokens[i] == null_token ? " (null_token) but no media chunk covers it" : ", must be >= 0");
    }
    return std::nullopt;
}

/// Everything the bytes depend on besides the cells (the fingerprint of format.hpp).
/// rope_ext is the header's rope-scaling word (offset 76, see format.hpp), not part of the
/// 48-byte fingerprint block.
struct fingerprint {
    std::uint32_t n_layer, n_head_kv, head_dim_k, head_dim_v, type_id, elem_size;
    std::uint32_t rope_type, n_rot, freq_base_bits, freq_scale_bits, layout_id, window;
    std::uint32_t rope_ext;
};

/// The rope-scaling word: 0 when the RoPE uses nothing beyond type, freq_base, freq_scale
/// and n_rot (every state written before the word existed), else a nonzero 32-bit hash of
/// the fields in use: ntk_alpha, attn_factor, scaling, and for the selected scaling
/// n_ctx_orig, its parameters (yarn / llama3) and its factor tables (freq_factors, or
/// short_factors and long_factors), each as f32 bits with the table sizes, then the M-RoPE
/// sections and layout when M-RoPE is on. Fields of a
/// scaling not selected are left out, so they never make two equal RoPEs differ.
inline std::uint32_t rope_ext_word(const rope_params& r) noexcept {
    if (!r.extended()) return 0;
    hasher h;  // XXH3-64 of the fields in use, in this order
    auto put_u32 = [&](std::uint32_t v) { h.update(&v, 4); };
    auto put_f32 = [&](float v) { h.update(&v, 4); };
    auto put_table = [&](const rope_factors& t) {
        put_u32(static_cast<std::uint32_t>(t.size()));
        if (!t.empty()) h.update(t.data(), t.size() * 4);
    };
    put_u32(1);  // version of this encoding
    put_f32(r.ntk_alpha);
    put_f32(r.attn_factor);
    put_u32(static_cast<std::uint32_t>(r.scaling));
    if (r.scaling != rope_scaling::none) put_u32(r.n_ctx_orig);
    switch (r.scaling) {
        case rope_scaling::yarn:
            put_f32(r.yarn.ext_factor);
            put_f32(r.yarn.beta_fast);
            put_f32(r.yarn.beta_slow);
            put_table(r.freq_factors);
            break;
        case rope_scaling::llama3:
            put_f32(r.llama3.factor);
            put_f32(r.llama3.low_freq_factor);
            put_f32(r.llama3.high_freq_factor);
            break;
        case rope_scaling::longrope:
            put_table(r.short_factors);
            put_table(r.long_factors);
            break;
        default: put_table(r.freq_factors);
    }
    if (r.mrope.on()) {  // appended: the words of every RoPE without M-RoPE are unchanged
        put_u32(0x45504f52u);  // tag "ROPE"
        for (std::uint32_t v : r.mrope.sections) put_u32(v);
        put_u32(r.mrope.interleaved ? 1u : 0u);
    }
    const std::uint64_t d = h.digest();
    const auto w = static_cast<std::uint32_t>(d ^ (d >> 32));
    return w == 0 ? 1u : w;
}

/// The attention window of a layout (0 when it keeps every cell).
template <class Cache>
std::uint32_t layout_window(const Cache& cache) noexcept {
    if constexpr (cache_has_capability<Cache, layout_caps::sliding_window>())
        return static_cast<std::uint32_t>(cache.storage().window());
    else
        return 0;
}

template <class Cache>
fingerprint fingerprint_of(const Cache& cache) noexcept {
    const model_shape& s = cache.shape();
    fingerprint f{};
    f.n_layer = s.n_layer;
    f.n_head_kv = s.n_head_kv;
    f.head_dim_k = s.dim_k();
    f.head_dim_v = s.dim_v();
    f.type_id = static_cast<std::uint32_t>(Cache::element::type_id);
    f.elem_size = elem_size_word(sizeof(typename Cache::storage_type), element_block_size_v<typename Cache::element>);
    f.rope_type = static_cast<std::uint32_t>(s.rope.type);
    f.n_rot = s.n_rot();
    std::memcpy(&f.freq_base_bits, &s.rope.freq_base, 4);
    std::memcpy(&f.freq_scale_bits, &s.rope.freq_scale, 4);
    f.layout_id = static_cast<std::uint32_t>(Cache::layout::layout_id);
    f.window = layout_window(cache);
    f.rope_ext = rope_ext_word(s.rope);
    return f;
}

template <class Cache>
constexpr void require_raw_view() {
    static_assert(requires(const typename Cache::storage_t& s) { s.view(0u).k_offset(0u, 0u, 0u); },
                  "kvcache::io: state I/O needs a layout storage with view(layer) returning a kv_layer_view "
                  "(see format/kv_view.hpp)");
}

/// How a fingerprint field must match the cache when loading.
enum class fp_rule : std::uint8_t {
    exact,          ///< equal, else the field's errc
    informational,  ///< not checked (layout_id: states load across layouts)
    window,         ///< equal when both state and cache have one (0 = none)
};

/// One fingerprint field of the fixed header (format.hpp): write_state writes the table
/// in order, parse_state checks it in order.
struct fp_field {
    std::uint32_t fingerprint::*member;
    const char* name;
    errc code;
    fp_rule rule;
};

inline constexpr fp_field fingerprint_fields[] = {
    {&fingerprint::n_layer, "n_layer", errc::shape_mismatch, fp_rule::exact},
    {&fingerprint::n_head_kv, "n_head_kv", errc::shape_mismatch, fp_rule::exact},
    {&fingerprint::head_dim_k, "head_dim_k", errc::shape_mismatch, fp_rule::exact},
    {&fingerprint::head_dim_v, "head_dim_v", errc::shape_mismatch, fp_rule::exact},
    {&fingerprint::type_id, "element type_id", errc::dtype_mismatch, fp_rule::exact},
    {&fingerprint::elem_size, "element size", errc::dtype_mismatch, fp_rule::exact},
    {&fingerprint::rope_type, "rope type", errc::shape_mismatch, fp_rule::exact},
    {&fingerprint::n_rot, "rope n_rot", errc::shape_mismatch, fp_rule::exact},
    {&fingerprint::freq_base_bits, "rope freq_base bits", errc::shape_mismatch, fp_rule::exact},
    {&fingerprint::freq_scale_bits, "rope freq_scale bits", errc::shape_mismatch, fp_rule::exact},
    {&fingerprint::layout_id, "layout_id", errc::shape_mismatch, fp_rule::informational},
    {&fingerprint::window, "window", errc::shape_mismatch, fp_rule::window},
};
static_assert(sizeof(fingerprint_fields) / sizeof(fp_field) * 4 == off::seq - off::n_layer,
              "the fingerprint table must cover the header's fingerprint bytes");

/// The rope-scaling word at off::rope_ext (after seq): written by write_state, checked
/// equal by parse_state (a state saved with one RoPE scaling is refused by a cache with
/// another; a state of plain RoPE has 0 there, as every state before the word existed).
inline constexpr fp_field rope_ext_field = {&fingerprint::rope_ext, "rope scaling word", errc::shape_mismatch,
                                            fp_rule::exact};

}  // namespace detail

}  // namespace io
KVCACHE_END_NAMESPACE
