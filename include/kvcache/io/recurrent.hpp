// kvcache: state files of a recurrent_memory (F15 for F17): the whole memory or one
// sequence, with an optional prompt, as one little-endian byte string. Overloads of
// io::state_size / seq_state_size / save_state / save_seq / load_state / load_seq, so
// code written against io/state.hpp works unchanged on a recurrent_memory.
//
//   offset size  field
//   0      4     magic "KVRS"
//   4      4     format version (1)
//   8      8     total_size: bytes of the whole state, checksum included
//   16     4     kind: 0 = whole memory, 1 = one sequence
//   20     4     flags: 0 (no flag is defined)
//   24     16    fingerprint: n_layer, d_conv, d_inner, ssm_size of recurrent_shape (each
//                must equal the memory's; n_seq_max may differ)
//   40     4     seq: the saved sequence for kind 1, -1 for kind 0
//   44     4     n_records: sequences that follow (kind 1: 0 for an empty sequence, or 1)
//   48     8     n_tokens
//   56           tokens:  n_tokens x i32
//                records: n_records x {i32 seq, i32 pos_min, i32 pos_max,
//                                      seq_floats() x f32 (layer by layer: conv then SSM)}
//                         seq ids strictly increasing; kind 1: exactly {seq};
//                         0 <= pos_min <= pos_max; only non-empty sequences are written
//   end-8  8     XXH3-64 of every byte before it
//
// Loading parses and validates everything before it changes the memory: on any failure
// the result carries bad_magic, unsupported_version, truncated, trailing_bytes,
// checksum_mismatch, unsupported (kind or flags), shape_mismatch, no_space (a sequence
// id the memory does not have, too many tokens) or invalid_cell, and the memory is
// bit-identical. load_state replaces every sequence (those the state lacks become
// empty); load_seq replaces sequence dst only.
#pragma once

#include <cstddef>  // std::byte, std::size_t
#include <cstdint>  // fixed-width integers
#include <cstring>  // std::memcpy
#include <optional> // checked sizes
#include <span>     // inputs and outputs
#include <string>   // messages
#include <vector>   // buffers

#include "../detail/policy_select.hpp"
#include "../error.hpp"
#include "../memory/recurrent.hpp"
#include "../tokens/token.hpp"
#include "detail/xxhash.hpp"
#include "format.hpp"
#include "types.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace io {

/// Magic of a recurrent state: the bytes "KVRS".
inline constexpr std::uint32_t recurrent_magic = 0x5352564Bu;
/// Recurrent state format version written and read by this library.
inline constexpr std::uint32_t recurrent_version = 1;
/// Bytes before the token list.
inline constexpr std::size_t recurrent_header_size = 56;
/// Bytes of a sequence record before its floats.
inline constexpr std::size_t recurrent_record_head = 12;

namespace detail {

/// Size of a recurrent state, or nothing when it overflows 64 bits.
inline std::optional<std::uint64_t> recurrent_bytes(const recurrent_shape& sh, std::uint64_t n_records,
                                                    std::uint64_t n_tokens) {
    const auto rec = mul_u64(sh.seq_floats(), sizeof(float));
    if (!rec) return std::nullopt;
    const auto recs = mul_u64(n_records, *rec + recurrent_record_head);
    const auto toks = mul_u64(n_tokens, sizeof(token_t));
    if (!recs || !toks) return std::nullopt;
    const auto a = add_u64(*recs, *toks);
    if (!a) return std::nullopt;
    return add_u64(*a, recurrent_header_size + state_checksum_size);
}

inline std::vector<seq_id_t> recurrent_seqs_to_save(const recurrent_memory& m, seq_id_t seq) {
    std::vector<seq_id_t> out;
    for (seq_id_t s = 0; static_cast<std::uint32_t>(s) < m.n_seq_max(); ++s)
        if ((seq < 0 || s == seq) && m.seq_pos_max(s) >= 0) out.push_back(s);
    return out;
}

inline std::vector<std::byte> write_recurrent(const recurrent_memory& m, seq_id_t seq, std::span<const token_t> tokens) {
    const recurrent_shape& sh = m.shape();
    const std::vector<seq_id_t> seqs = recurrent_seqs_to_save(m, seq);
    std::vector<std::byte> out(*recurrent_bytes(sh, seqs.size(), tokens.size()));
    byte_writer w{std::span<std::byte>(out)};
    w.put(recurrent_magic);
    w.put(recurrent_version);
    w.put(static_cast<std::uint64_t>(out.size()));
    w.put(static_cast<std::uint32_t>(seq < 0 ? state_kind::whole_cache : state_kind::one_sequence));
    w.put(std::uint32_t{0});
    w.put(sh.n_layer);
    w.put(sh.d_conv);
    w.put(sh.d_inner);
    w.put(sh.ssm_size);
    w.put(static_cast<std::int32_t>(seq < 0 ? -1 : seq));
    w.put(static_cast<std::uint32_t>(seqs.size()));
    w.put(static_cast<std::uint64_t>(tokens.size()));
    w.put_bytes(tokens.data(), tokens.size_bytes());
    for (seq_id_t s : seqs) {
        w.put(static_cast<std::int32_t>(s));
        w.put(static_cast<std::int32_t>(m.seq_pos_min(s)));
        w.put(static_cast<std::int32_t>(m.seq_pos_max(s)));
        const std::span<const float> st = m.seq_state(s);
        w.put_bytes(st.data(), st.size_bytes());
    }
    const std::uint64_t sum = checksum(std::span<const std::byte>(out).first(out.size() - state_checksum_size));
    w.put(sum);
    return out;
}

/// A parsed, validated recurrent state (records point into the input bytes).
struct recurrent_staged {
    std::int32_t seq = -1;
    std::vector<token_t> tokens;
    struct record {
        seq_id_t seq;
        pos_t pos_min, pos_max;
        const std::byte* floats;
    };
    std::vector<record> records;
};

inline result<recurrent_staged> parse_recurrent(const char* fn, const recurrent_memory& m, std::span<const std::byte> in,
                                                state_kind want, const load_options& opt) {
    using std::to_string;
    auto fail = [fn](errc c, const std::string& msg) { return kvcache::detail::make_error(c, std::string(fn) + ": " + msg); };
    const recurrent_shape& sh = m.shape();
    constexpr std::size_t min_size = recurrent_header_size + state_checksum_size;
    if (in.size() >= 4 && load_le<std::uint32_t>(in.data()) != recurrent_magic)
        return fail(errc::bad_magic, "the bytes do not start with \"KVRS\" (a recurrent state)");
    if (in.size() < 8)
        return fail(errc::truncated, to_string(in.size()) + " bytes, a recurrent state has at least " + to_string(min_size));
    if (const auto v = load_le<std::uint32_t>(in.data() + 4); v != recurrent_version)
        return fail(errc::unsupported_version, "version " + to_string(v) + ", this library reads version " +
                                                   to_string(recurrent_version));
    if (in.size() < min_size)
        return fail(errc::truncated, to_string(in.size()) + " bytes, a recurrent state has at least " + to_string(min_size));
    byte_reader r{in};
    r.take(8);
    const auto total = r.get<std::uint64_t>();
    if (total > in.size())
        return fail(errc::truncated, "total_size = " + to_string(total) + " but only " + to_string(in.size()) + " bytes");
    if (total < in.size())
        return fail(errc::trailing_bytes, to_string(in.size() - total) + " bytes after the state's end (total_size = " +
                                              to_string(total) + ")");
    const std::uint64_t want_sum = load_le<std::uint64_t>(in.data() + in.size() - state_checksum_size);
    if (const std::uint64_t got = checksum(in.first(in.size() - state_checksum_size)); got != want_sum)
        return fail(errc::checksum_mismatch, "the checksum does not match the contents");
    const auto kind = r.get<std::uint32_t>();
    if (kind > 1) return fail(errc::unsupported, "state kind " + to_string(kind) + " unknown (0 or 1)");
    if (kind != static_cast<std::uint32_t>(want))
        return fail(errc::unsupported, kind == 0 ? "the bytes hold a whole memory; use load_state"
                                                 : "the bytes hold one sequence; use load_seq");
    if (const auto flags = r.get<std::uint32_t>(); flags != 0)
        return fail(errc::unsupported, "flags = " + to_string(flags) + ", version 1 defines none");
    const std::uint32_t fp[4] = {r.get<std::uint32_t>(), r.get<std::uint32_t>(), r.get<std::uint32_t>(),
                                 r.get<std::uint32_t>()};
    const std::uint32_t mine[4] = {sh.n_layer, sh.d_conv, sh.d_inner, sh.ssm_size};
    const char* names[4] = {"n_layer", "d_conv", "d_inner", "ssm_size"};
    for (int i = 0; i < 4; ++i)
        if (fp[i] != mine[i])
            return fail(errc::shape_mismatch, std::string(names[i]) + " = " + to_string(fp[i]) +
                                                  " in the state, the memory has " + to_string(mine[i]));
    recurrent_staged st;
    st.seq = r.get<std::int32_t>();
    if (kind == 0 ? st.seq != -1 : st.seq < 0)
        return fail(errc::invalid_cell,
                    "seq = " + to_string(st.seq) + (kind == 0 ? ", must be -1 for a whole memory" : ", must be >= 0"));
    const auto n_records = r.get<std::uint32_t>();
    const auto n_tokens = r.get<std::uint64_t>();
    if (n_tokens > opt.max_tokens)
        return fail(errc::no_space, "n_tokens = " + to_string(n_tokens) + " exceeds the limit " +
                                        to_string(opt.max_tokens) + " (load_options.max_tokens)");
    if (kind == 1 && n_records > 1)
        return fail(errc::invalid_cell, "n_records = " + to_string(n_records) + ", one sequence has 0 or 1");
    const auto need = recurrent_bytes(sh, n_records, n_tokens);
    if (!need || *need != total)
        return fail(errc::invalid_cell, "n_records = " + to_string(n_records) + " and n_tokens = " + to_string(n_tokens) +
                                            " do not add up to total_size = " + to_string(total));
    st.tokens.resize(static_cast<std::size_t>(n_tokens));
    if (n_tokens != 0) std::memcpy(st.tokens.data(), r.take(st.tokens.size() * sizeof(token_t)), st.tokens.size() * sizeof(token_t));
    const std::size_t floats_bytes = sh.seq_floats() * sizeof(float);
    st.records.reserve(n_records);
    for (std::uint32_t i = 0; i < n_records; ++i) {
        recurrent_staged::record rec{r.get<std::int32_t>(), r.get<std::int32_t>(), r.get<std::int32_t>(), nullptr};
        rec.floats = r.take(floats_bytes);
        const std::string at = "record " + to_string(i) + ": ";
        if (rec.seq < 0 || (i > 0 && rec.seq <= st.records.back().seq))
            return fail(errc::invalid_cell, at + "seq = " + to_string(rec.seq) + ", sequence ids must be >= 0 and increase");
        if (kind == 1 && rec.seq != st.seq)
            return fail(errc::invalid_cell, at + "seq = " + to_string(rec.seq) + ", the state is of sequence " + to_string(st.seq));
        if (kind == 0 && static_cast<std::uint32_t>(rec.seq) >= m.n_seq_max())
            return fail(errc::no_space, at + "sequence " + to_string(rec.seq) + ", the memory has n_seq_max = " +
                                            to_string(m.n_seq_max()));
        if (rec.pos_min < 0 || rec.pos_min > rec.pos_max)
            return fail(errc::invalid_cell, at + "positions [" + to_string(rec.pos_min) + ", " + to_string(rec.pos_max) +
                                                "], must be 0 <= pos_min <= pos_max");
        st.records.push_back(rec);
    }
    KVCACHE_ASSERT(r.left() == state_checksum_size);
    return st;
}

inline void recurrent_check_save(const char* fn, const recurrent_memory& m, seq_id_t seq, bool one) {
    if (one && (seq < 0 || static_cast<std::uint32_t>(seq) >= m.n_seq_max()))
        kvcache::detail::fail(errc::invalid_argument, std::string(fn) + ": seq = " + std::to_string(seq) +
                                                          ", must be in [0, " + std::to_string(m.n_seq_max()) + ")");
}

inline void recurrent_check_load(const char* fn, const recurrent_memory& m) {
    if (m.in_transaction())
        kvcache::detail::fail(errc::transaction_open,
                              std::string(fn) + ": placements are staged; commit() or restore() first");
}

/// A validated recurrent state made ready to apply: every allocation done.
struct recurrent_prepared {
    recurrent_staged staged;
    load_info info;
    std::vector<float> buf;  // the records' floats may be unaligned
    seq_id_t dst = -1;
};

/// Allocates what applying needs (may throw std::bad_alloc; nothing changed then).
inline recurrent_prepared recurrent_prepare(const recurrent_memory& m, recurrent_staged&& st, seq_id_t dst) {
    recurrent_prepared p;
    p.dst = dst;
    p.info.kind = dst < 0 ? state_kind::whole_cache : state_kind::one_sequence;
    p.info.saved_seq = st.seq;
    p.info.cells.reserve(st.records.size());
    for (const auto& rec : st.records) p.info.cells.push_back(static_cast<std::uint32_t>(dst < 0 ? rec.seq : dst));
    p.buf.resize(m.shape().seq_floats());
    p.staged = std::move(st);
    return p;
}
/// recurrent_prepare for a memory about to change: a compound operation's guard
/// (recurrent_memory::begin_guard) copies the states the load overwrites first.
inline recurrent_prepared recurrent_prepare(recurrent_memory& m, recurrent_staged&& st, seq_id_t dst) {
    recurrent_prepared p = recurrent_prepare(static_cast<const recurrent_memory&>(m), std::move(st), dst);
    m.guard_seqs(kvcache::detail::internal_access{}, dst);
    return p;
}

/// Applies a prepared state: the memory changes all at once. Never throws.
inline void recurrent_apply(recurrent_memory& m, recurrent_prepared& p) noexcept {
    const kvcache::detail::internal_access a{};
    if (p.dst < 0)
        for (seq_id_t s = 0; static_cast<std::uint32_t>(s) < m.n_seq_max(); ++s) m.empty_seq(a, s);
    else
        m.empty_seq(a, p.dst);
    for (const auto& rec : p.staged.records) {
        if (!p.buf.empty()) std::memcpy(p.buf.data(), rec.floats, p.buf.size() * sizeof(float));
        m.assign_seq(a, p.dst < 0 ? rec.seq : p.dst, rec.pos_min, rec.pos_max, p.buf.data());
    }
}

inline load_info recurrent_commit(recurrent_memory& m, recurrent_staged&& st, seq_id_t dst) {
    recurrent_prepared p = recurrent_prepare(m, std::move(st), dst);
    recurrent_apply(m, p);
    p.info.tokens = std::move(p.staged.tokens);
    return std::move(p.info);
}

}  // namespace detail

/// Bytes save_state(mem, tokens) writes.
[[nodiscard]] inline std::size_t state_size(const recurrent_memory& mem, std::span<const token_t> tokens = {}) {
    return *detail::recurrent_bytes(mem.shape(), detail::recurrent_seqs_to_save(mem, -1).size(), tokens.size());
}
/// Bytes save_seq(mem, seq, tokens) writes.
[[nodiscard]] inline std::size_t seq_state_size(const recurrent_memory& mem, seq_id_t seq,
                                                std::span<const token_t> tokens = {}) {
    detail::recurrent_check_save("seq_state_size", mem, seq, true);
    return *detail::recurrent_bytes(mem.shape(), detail::recurrent_seqs_to_save(mem, seq).size(), tokens.size());
}
/// Serialises every sequence of a recurrent memory (states and intervals) and an
/// optional prompt. Staged placements are saved as they stand (commit first).
[[nodiscard]] inline std::vector<std::byte> save_state(const recurrent_memory& mem, std::span<const token_t> tokens = {}) {
    return detail::write_recurrent(mem, -1, tokens);
}
/// Serialises one sequence (nothing but the header when it is empty). Throws
/// invalid_argument for seq outside [0, n_seq_max).
[[nodiscard]] inline std::vector<std::byte> save_seq(const recurrent_memory& mem, seq_id_t seq,
                                                     std::span<const token_t> tokens = {}) {
    detail::recurrent_check_save("save_seq", mem, seq, true);
    return detail::write_recurrent(mem, seq, tokens);
}
/// Replaces every sequence by the state in `bytes` (saved by save_state from a memory
/// of the same recurrent_shape, n_seq_max aside). Errors: see the file comment; the
/// memory is unchanged then. Throws transaction_open when placements are staged.
/// load_info::cells lists the loaded sequences.
[[nodiscard]] inline result<load_info> load_state(recurrent_memory& mem, std::span<const std::byte> bytes,
                                                  const load_options& opt = {}) {
    detail::recurrent_check_load("load_state", mem);
    auto st = detail::parse_recurrent("load_state", mem, bytes, state_kind::whole_cache, opt);
    if (!st) return kvcache::detail::make_error(st.code(), st.message());
    return detail::recurrent_commit(mem, std::move(st.value()), -1);
}
/// Loads one sequence saved by save_seq into sequence dst, replacing what dst held.
/// Errors as load_state; throws invalid_argument for dst outside [0, n_seq_max).
[[nodiscard]] inline result<load_info> load_seq(recurrent_memory& mem, seq_id_t dst, std::span<const std::byte> bytes,
                                                const load_options& opt = {}) {
    detail::recurrent_check_load("load_seq", mem);
    detail::recurrent_check_save("load_seq", mem, dst, true);
    auto st = detail::parse_recurrent("load_seq", mem, bytes, state_kind::one_sequence, opt);
    if (!st) return kvcache::detail::make_error(st.code(), st.message());
    return detail::recurrent_commit(mem, std::move(st.value()), dst);
}

}  // namespace io
KVCACHE_END_NAMESPACE
