// kvcache io: the fixed header of a state (format.hpp, offsets 16..103) as one table of
// field descriptors. write.hpp writes the fields in table order, parse.hpp reads them in
// the same order and checks each with the rule its descriptor names, so a field is
// declared once: its width, its name in messages and what a loader accepts.
#pragma once

#include <bit>       // std::bit_cast (the RoPE floats in messages)
#include <charconv>  // std::to_chars
#include <cstdint>   // fixed-width integers
#include <optional>  // a refusal or nothing
#include <string>    // messages
#include <tuple>        // the descriptor table (fields of several widths)
#include <type_traits>  // std::is_same_v

#include "../element/bf16.hpp"
#include "../element/f16.hpp"
#include "../element/f32.hpp"
#include "../element/q4_0.hpp"
#include "../element/q8_0.hpp"
#include "../error.hpp"
#include "fingerprint.hpp"
#include "format.hpp"
#include "types.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace io {
namespace detail {

/// A refusal found while reading a state: its code and message (without the caller's name).
struct parse_problem {
    errc code;
    std::string msg;
};
using maybe_problem = std::optional<parse_problem>;

/// The fixed header after magic, version and total size.
struct state_header {
    std::uint32_t kind = 0;   ///< state_kind
    std::uint32_t flags = 0;  ///< state_flag_*
    fingerprint fp{};         ///< what the bytes depend on besides the cells
    std::int32_t seq = -1;    ///< the saved sequence (kind 1), -1 (kind 0)
    std::uint32_t rope_ext = 0;  ///< rope scaling word (fingerprint.hpp rope_ext_word; 0 = plain RoPE)
    std::uint64_t n_tokens = 0, n_media = 0, n_cells = 0;
};

/// What the header is checked against: the call's expectations and the cache's fingerprint.
struct header_expect {
    state_kind kind;         ///< what the caller loads (load_state: whole cache, load_seq: one sequence)
    fingerprint fp;          ///< the destination cache's
    std::uint64_t max_tokens;  ///< load_options::max_tokens
};

/// One scalar field of the header: where it lives in state_header, its name in messages,
/// and the rule a loader applies to it (nullptr: any value; later stages check it against
/// the bytes that follow).
template <class T>
struct header_field {
    T state_header::*member;
    const char* name;
    maybe_problem (*check)(const state_header&, const header_expect&);
};

/// The fingerprint's place in the header: its own table (fingerprint.hpp) of fields.
struct fingerprint_block {};

namespace rules {

inline maybe_problem kind(const state_header& h, const header_expect& e) {
    if (h.kind > 1) return parse_problem{errc::unsupported, "state kind " + std::to_string(h.kind) + " unknown (0 or 1)"};
    if (h.kind != static_cast<std::uint32_t>(e.kind))
        return parse_problem{errc::unsupported, h.kind == 0 ? "the bytes hold a whole cache; use load_state"
                                                            : "the bytes hold one sequence; use load_seq"};
    return std::nullopt;
}

inline maybe_problem flags(const state_header& h, const header_expect&) {
    if ((h.flags & ~(state_flag_pruning | state_flag_mrope)) != 0)
        return parse_problem{errc::unsupported, "flags = " + hex(h.flags) +
                                                    ", version 1 defines only bit 0 (pruning table) and bit 1 "
                                                    "(M-RoPE positions)"};
    return std::nullopt;
}

/// A fingerprint value as a refusal shows it: the RoPE floats as numbers (their stored bits
/// after), the built-in elements' type ids with their names, the rest as numbers.
inline std::string fp_show(const fp_field& d, std::uint32_t v) {
    if (d.member == &fingerprint::freq_base_bits || d.member == &fingerprint::freq_scale_bits) {
        char buf[64];
        const auto r = std::to_chars(buf, buf + sizeof buf, std::bit_cast<float>(v), std::chars_format::fixed);
        return std::string(buf, r.ptr) + " (bits " + hex(v) + ")";
    }
    if (d.member == &fingerprint::type_id) {
        const char* name = v == f32::type_id    ? "f32"
                           : v == f16::type_id  ? "f16"
                           : v == bf16::type_id ? "bf16"
                           : v == q8_0::type_id ? "q8_0"
                           : v == q4_0::type_id ? "q4_0"
                                                : "a custom element";
        return std::to_string(v) + " (" + name + ")";
    }
    return std::to_string(v);
}

inline maybe_problem fingerprint(const state_header& h, const header_expect& e) {
    for (const fp_field& d : fingerprint_fields) {
        const std::uint32_t got = h.fp.*d.member;
        const std::uint32_t want = e.fp.*d.member;
        if (d.rule == fp_rule::informational) continue;
        if (d.rule == fp_rule::window && (want == 0 || got == 0)) continue;
        if (got != want)
            return parse_problem{d.code, std::string(d.name) + " = " + fp_show(d, got) + " in the state, the cache has " +
                                             fp_show(d, want)};
    }
    return std::nullopt;
}

inline maybe_problem seq(const state_header& h, const header_expect&) {
    const bool whole = h.kind == static_cast<std::uint32_t>(state_kind::whole_cache);
    if (whole ? h.seq != -1 : h.seq < 0)
        return parse_problem{errc::invalid_cell, "seq = " + std::to_string(h.seq) +
                                                     (whole ? ", must be -1 for a whole cache" : ", must be >= 0")};
    return std::nullopt;
}

inline maybe_problem rope_ext(const state_header& h, const header_expect& e) {
    if (h.rope_ext != e.fp.*rope_ext_field.member)
        return parse_problem{rope_ext_field.code,
                             std::string(rope_ext_field.name) + " = " + hex(h.rope_ext) + " in the state, the cache has " +
                                 hex(e.fp.*rope_ext_field.member) +
                                 " (0 = plain RoPE): saved with other RoPE scaling (rope_params ntk_alpha, attn_factor, "
                                 "scaling, n_ctx_orig, yarn, llama3, factor tables)"};
    return std::nullopt;
}

inline maybe_problem n_tokens(const state_header& h, const header_expect& e) {
    if (h.n_tokens > e.max_tokens)
        return parse_problem{errc::no_space, "n_tokens = " + std::to_string(h.n_tokens) + " exceeds the limit " +
                                                 std::to_string(e.max_tokens) + " (load_options.max_tokens)"};
    return std::nullopt;
}

inline maybe_problem n_media(const state_header& h, const header_expect&) {
    if (h.n_media > h.n_tokens)
        return parse_problem{errc::invalid_cell, "n_media = " + std::to_string(h.n_media) + " exceeds n_tokens = " +
                                                     std::to_string(h.n_tokens) + " (each chunk covers a position)"};
    return std::nullopt;
}

}  // namespace rules

/// The header, field by field, in file order (format.hpp's table, offsets 16..103).
inline constexpr auto header_fields = std::tuple{
    header_field<std::uint32_t>{&state_header::kind, "kind", &rules::kind},
    header_field<std::uint32_t>{&state_header::flags, "flags", &rules::flags},
    fingerprint_block{},
    header_field<std::int32_t>{&state_header::seq, "seq", &rules::seq},
    header_field<std::uint32_t>{&state_header::rope_ext, "rope scaling word", &rules::rope_ext},
    header_field<std::uint64_t>{&state_header::n_tokens, "n_tokens", &rules::n_tokens},
    header_field<std::uint64_t>{&state_header::n_media, "n_media", &rules::n_media},
    header_field<std::uint64_t>{&state_header::n_cells, "n_cells", nullptr},  // against room: parse.hpp
};

namespace header_detail {
template <class T>
constexpr std::size_t width(const header_field<T>&) { return sizeof(T); }
constexpr std::size_t width(const fingerprint_block&) { return sizeof(fingerprint_fields) / sizeof(fp_field) * 4; }
}  // namespace header_detail

static_assert(std::apply([](const auto&... f) { return (header_detail::width(f) + ...); }, header_fields) ==
                  state_header_size - off::kind,
              "the header table must cover the fixed header from `kind` to the token list");

/// Writes `h` after magic, version and size, in table order.
inline void write_header(byte_writer& w, const state_header& h) {
    std::apply([&](const auto&... field) {
        auto one = [&](const auto& f) {
            if constexpr (std::is_same_v<std::decay_t<decltype(f)>, fingerprint_block>) {
                for (const fp_field& d : fingerprint_fields) w.put<std::uint32_t>(h.fp.*d.member);
            } else {
                w.put(h.*f.member);
            }
        };
        (one(field), ...);
    }, header_fields);
}

/// Reads the header in table order; the caller checked the input holds state_header_size bytes
/// and positioned `r` at offset off::kind.
inline state_header read_header(byte_reader& r) {
    state_header h;
    std::apply([&](const auto&... field) {
        auto one = [&](const auto& f) {
            if constexpr (std::is_same_v<std::decay_t<decltype(f)>, fingerprint_block>) {
                for (const fp_field& d : fingerprint_fields) h.fp.*d.member = r.get<std::uint32_t>();
            } else {
                using T = std::remove_reference_t<decltype(h.*f.member)>;
                h.*f.member = r.get<T>();
            }
        };
        (one(field), ...);
    }, header_fields);
    return h;
}

/// Applies every field's rule in table order; the first refusal, or nothing.
inline maybe_problem check_header(const state_header& h, const header_expect& e) {
    maybe_problem bad;
    std::apply([&](const auto&... field) {
        auto one = [&](const auto& f) {
            if (bad) return;
            if constexpr (std::is_same_v<std::decay_t<decltype(f)>, fingerprint_block>)
                bad = rules::fingerprint(h, e);
            else if (f.check != nullptr)
                bad = f.check(h, e);
        };
        (one(field), ...);
    }, header_fields);
    return bad;
}

}  // namespace detail
}  // namespace io
KVCACHE_END_NAMESPACE
