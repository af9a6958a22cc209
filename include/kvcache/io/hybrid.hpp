// kvcache: state files of a hybrid_memory: the attention part's state (io/state.hpp, with
// the prompt) and the recurrent part's state (io/recurrent.hpp) in one envelope.
// Overloads of io::save_state / save_seq / load_state / load_seq.
//
//   offset size  field
//   0      4     magic "KVHY"
//   4      4     format version (1)
//   8      8     total_size: bytes of the whole state, checksum included
//   16     4     kind: 0 = whole memory, 1 = one sequence
//   20     4     n_layer: model layers of the hybrid memory
//   24     8     layer pattern: XXH3-64 of n_layer bytes, 1 for a recurrent layer, 0 for an
//                attention layer (must equal the memory's)
//   32     8     a: bytes of the attention part
//   40     8     r: bytes of the recurrent part
//   48     a     the attention part (a complete state of io/state.hpp, its own checksum)
//   48+a   r     the recurrent part (a complete state of io/recurrent.hpp)
//   end-8  8     XXH3-64 of every byte before it
//
// Loading validates the envelope and the recurrent part, makes the recurrent part ready
// to apply (every allocation done), then loads the attention part (which validates all
// of it before changing anything) and finally applies the recurrent part, which cannot
// fail: a refused state leaves both parts unchanged. Before the attention part changes,
// both parts must hold the same positions (per sequence the same last position, the
// attention part no earlier first one): invalid_cell otherwise. Errors as io/state.hpp
// and io/recurrent.hpp; a memory with another layer pattern: shape_mismatch.
#pragma once

#include <cstddef>  // std::byte, std::size_t
#include <cstdint>  // fixed-width integers
#include <optional> // part 0 of a composite attention state
#include <span>     // inputs and outputs
#include <string>   // messages
#include <utility>  // std::as_const
#include <vector>   // buffers

#include "../detail/policy_select.hpp"
#include "../error.hpp"
#include "../memory/hybrid.hpp"
#include "../tokens/token.hpp"
#include "detail/xxhash.hpp"
#include "format.hpp"
#include "recurrent.hpp"
#include "state.hpp"
#include "types.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace io {

/// Magic of a hybrid state: the bytes "KVHY".
inline constexpr std::uint32_t hybrid_magic = 0x5948564Bu;
/// Hybrid state format version written and read by this library.
inline constexpr std::uint32_t hybrid_version = 1;
/// Bytes before the attention part.
inline constexpr std::size_t hybrid_header_size = 48;

namespace detail {

template <class A>
std::uint64_t hybrid_pattern(const hybrid_memory<A>& h) {
    std::vector<std::byte> b(h.n_layer());
    for (std::uint32_t l = 0; l < h.n_layer(); ++l) b[l] = std::byte{static_cast<unsigned char>(h.is_recurrent(l))};
    return checksum(std::span<const std::byte>(b));
}

template <class A>
std::vector<std::byte> write_hybrid(const hybrid_memory<A>& h, state_kind kind, std::span<const std::byte> attn,
                                    std::span<const std::byte> rec) {
    std::vector<std::byte> out(hybrid_header_size + attn.size() + rec.size() + state_checksum_size);
    byte_writer w{std::span<std::byte>(out)};
    w.put(hybrid_magic);
    w.put(hybrid_version);
    w.put(static_cast<std::uint64_t>(out.size()));
    w.put(static_cast<std::uint32_t>(kind));
    w.put(h.n_layer());
    w.put(hybrid_pattern(h));
    w.put(static_cast<std::uint64_t>(attn.size()));
    w.put(static_cast<std::uint64_t>(rec.size()));
    w.put_bytes(attn.data(), attn.size());
    w.put_bytes(rec.data(), rec.size());
    w.put(checksum(std::span<const std::byte>(out).first(out.size() - state_checksum_size)));
    return out;
}

/// The two parts of a hybrid state, after the envelope's checks.
struct hybrid_parts {
    std::span<const std::byte> attention, recurrent;
};

template <class A>
result<hybrid_parts> parse_hybrid(const char* fn, const hybrid_memory<A>& h, std::span<const std::byte> in,
                                  state_kind want) {
    using std::to_string;
    auto fail = [fn](errc c, const std::string& msg) { return kvcache::detail::make_error(c, std::string(fn) + ": " + msg); };
    constexpr std::size_t min_size = hybrid_header_size + state_checksum_size;
    if (in.size() >= 4 && load_le<std::uint32_t>(in.data()) != hybrid_magic)
        return fail(errc::bad_magic, "the bytes do not start with \"KVHY\" (a hybrid memory's state)");
    if (in.size() < 8)
        return fail(errc::truncated, to_string(in.size()) + " bytes, a hybrid state has at least " + to_string(min_size));
    if (const auto v = load_le<std::uint32_t>(in.data() + 4); v != hybrid_version)
        return fail(errc::unsupported_version,
                    "version " + to_string(v) + ", this library reads version " + to_string(hybrid_version));
    if (in.size() < min_size)
        return fail(errc::truncated, to_string(in.size()) + " bytes, a hybrid state has at least " + to_string(min_size));
    byte_reader r{in};
    r.take(8);
    const auto total = r.get<std::uint64_t>();
    if (total > in.size())
        return fail(errc::truncated, "total_size = " + to_string(total) + " but only " + to_string(in.size()) + " bytes");
    if (total < in.size())
        return fail(errc::trailing_bytes, to_string(in.size() - total) + " bytes after the state's end (total_size = " +
                                              to_string(total) + ")");
    if (checksum(in.first(in.size() - state_checksum_size)) !=
        load_le<std::uint64_t>(in.data() + in.size() - state_checksum_size))
        return fail(errc::checksum_mismatch, "the checksum does not match the contents");
    const auto kind = r.get<std::uint32_t>();
    if (kind > 1) return fail(errc::unsupported, "state kind " + to_string(kind) + " unknown (0 or 1)");
    if (kind != static_cast<std::uint32_t>(want))
        return fail(errc::unsupported, kind == 0 ? "the bytes hold a whole memory; use load_state"
                                                 : "the bytes hold one sequence; use load_seq");
    if (const auto n = r.get<std::uint32_t>(); n != h.n_layer())
        return fail(errc::shape_mismatch,
                    "n_layer = " + to_string(n) + " in the state, the memory has " + to_string(h.n_layer()));
    if (r.get<std::uint64_t>() != hybrid_pattern(h))
        return fail(errc::shape_mismatch, "the state's layer pattern (which layers are recurrent) differs from the memory's");
    const auto a = r.get<std::uint64_t>(), b = r.get<std::uint64_t>();
    const auto parts = add_u64(a, b);
    if (!parts || *parts != total - min_size)
        return fail(errc::invalid_cell, "part sizes " + to_string(a) + " + " + to_string(b) +
                                            " do not add up to total_size = " + to_string(total));
    hybrid_parts p;
    p.attention = in.subspan(hybrid_header_size, static_cast<std::size_t>(a));
    p.recurrent = in.subspan(hybrid_header_size + static_cast<std::size_t>(a), static_cast<std::size_t>(b));
    return p;
}

/// Refuses (invalid_cell) a state whose two parts hold different positions: per
/// sequence the attention part's cells must end at the recurrent interval's last
/// position (both empty or neither) and start no earlier than its first (an attention
/// layout may have pruned the oldest positions). `att` is the attention part (part 0
/// of a composite attention memory), staged for sequence `dst` (one sequence) or for
/// all (dst < 0).
inline result<void> hybrid_check_positions(const char* fn, const staged_state& att, const recurrent_staged& rec,
                                           std::uint32_t n_seq, seq_id_t dst) {
    struct span_t {
        std::int64_t mn = -1, mx = -1;
    };
    std::vector<span_t> a(n_seq), r(n_seq);
    auto widen = [](span_t& x, std::int64_t p) {
        if (x.mx < 0 || p < x.mn) x.mn = p;
        if (p > x.mx) x.mx = p;
    };
    for (std::size_t i = 0; i < att.pos.size(); ++i) {
        if (dst >= 0) {
            widen(a[static_cast<std::size_t>(dst)], att.pos[i]);
            continue;
        }
        att.seqs[i].for_each([&](seq_id_t s) {
            if (s >= 0 && static_cast<std::uint32_t>(s) < n_seq) widen(a[static_cast<std::size_t>(s)], att.pos[i]);
        });
    }
    for (const auto& x : rec.records) {
        const seq_id_t s = dst >= 0 ? dst : x.seq;
        if (s >= 0 && static_cast<std::uint32_t>(s) < n_seq) r[static_cast<std::size_t>(s)] = {x.pos_min, x.pos_max};
    }
    for (std::uint32_t s = 0; s < n_seq; ++s) {
        if (dst >= 0 && s != static_cast<std::uint32_t>(dst)) continue;
        if (a[s].mx == r[s].mx && a[s].mn >= r[s].mn) continue;
        auto show = [](const span_t& x) {
            return x.mx < 0 ? std::string("none") : "[" + std::to_string(x.mn) + ", " + std::to_string(x.mx) + "]";
        };
        return kvcache::detail::make_error(
            errc::invalid_cell, std::string(fn) + ": sequence " + std::to_string(s) +
                                    " holds positions " + show(a[s]) + " in the attention part but " + show(r[s]) +
                                    " in the recurrent part; both parts must hold the same positions");
    }
    return {};
}

template <class A>
result<load_info> load_hybrid(const char* fn, hybrid_memory<A>& h, std::span<const std::byte> in, state_kind kind,
                              seq_id_t dst, const load_options& opt) {
    const kvcache::detail::internal_access acc{};
    if (h.in_transaction())
        kvcache::detail::fail(errc::transaction_open,
                              std::string(fn) + ": placements are staged; commit() or restore() first");
    auto parts = parse_hybrid(fn, h, in, kind);
    if (!parts) return kvcache::detail::make_error(parts.code(), parts.message());
    auto st = parse_recurrent(fn, h.recurrent(), parts.value().recurrent, kind, opt);
    if (!st) return kvcache::detail::make_error(st.code(), st.message());
    recurrent_prepared rp = recurrent_prepare(h.recurrent_for_update(acc), std::move(st.value()), dst);
    A& attn = h.attention_for_update(acc);
    const std::span<const std::byte> att_bytes = parts.value().attention;
    auto load_attention = [&]() -> result<load_info> {
        if constexpr (composite_memory<A>) {
            // Part 0 (the full-attention cache) holds every position: check it, then load all.
            auto cparts = parse_composite(fn, att_bytes, expect_of(attn, kind));
            if (!cparts) return kvcache::detail::make_error(cparts.code(), cparts.message());
            std::optional<result<staged_state>> part0;
            std::as_const(attn).for_each_part([&](const auto& part) {
                if (!part0) part0.emplace(parse_state(fn, part, cparts.value()[0], kind, dst, opt));
            });
            if (!*part0) return kvcache::detail::make_error(part0->code(), part0->message());
            if (auto ok = hybrid_check_positions(fn, part0->value(), rp.staged, h.n_seq_max(), dst); !ok)
                return kvcache::detail::make_error(ok.code(), ok.message());
            return dst < 0 ? io::load_state(attn, att_bytes, opt) : io::load_seq(attn, dst, att_bytes, opt);
        } else {
            require_raw_view<A>();
            auto ast = parse_state(fn, attn, att_bytes, kind, dst, opt);
            if (!ast) return kvcache::detail::make_error(ast.code(), ast.message());
            if (auto ok = hybrid_check_positions(fn, ast.value(), rp.staged, h.n_seq_max(), dst); !ok)
                return kvcache::detail::make_error(ok.code(), ok.message());
            return commit_state(fn, attn, std::move(ast.value()), dst);
        }
    };
    result<load_info> r = load_attention();
    if (!r) return r;  // the attention part refused: nothing changed in either
    recurrent_apply(h.recurrent_for_update(acc), rp);
    return r;
}

}  // namespace detail

/// Serialises both parts of a hybrid memory (the prompt goes with the attention part).
template <class A>
[[nodiscard]] std::vector<std::byte> save_state(const hybrid_memory<A>& mem, std::span<const token_t> tokens = {},
                                                std::span<const media_chunk> media = {}) {
    return detail::write_hybrid(mem, state_kind::whole_cache, io::save_state(mem.attention(), tokens, media),
                                io::save_state(mem.recurrent()));
}
/// Serialises sequence seq of both parts. Throws invalid_argument for seq outside [0, n_seq_max).
template <class A>
[[nodiscard]] std::vector<std::byte> save_seq(const hybrid_memory<A>& mem, seq_id_t seq,
                                              std::span<const token_t> tokens = {},
                                              std::span<const media_chunk> media = {}) {
    return detail::write_hybrid(mem, state_kind::one_sequence, io::save_seq(mem.attention(), seq, tokens, media),
                                io::save_seq(mem.recurrent(), seq));
}
/// Replaces both parts by a state of save_state (see the file comment); on error neither
/// part changed. Throws transaction_open when placements are staged.
template <class A>
[[nodiscard]] result<load_info> load_state(hybrid_memory<A>& mem, std::span<const std::byte> bytes,
                                           const load_options& opt = {}) {
    return detail::load_hybrid("load_state", mem, bytes, state_kind::whole_cache, -1, opt);
}
/// Loads a state of save_seq into sequence dst of both parts, or of neither.
template <class A>
[[nodiscard]] result<load_info> load_seq(hybrid_memory<A>& mem, seq_id_t dst, std::span<const std::byte> bytes,
                                         const load_options& opt = {}) {
    if (dst < 0 || static_cast<std::uint32_t>(dst) >= mem.n_seq_max())
        kvcache::detail::fail(errc::invalid_argument, "load_seq: dst = " + std::to_string(dst) + ", must be in [0, " +
                                                          std::to_string(mem.n_seq_max()) + ")");
    return detail::load_hybrid("load_seq", mem, bytes, state_kind::one_sequence, dst, opt);
}

}  // namespace io
KVCACHE_END_NAMESPACE
