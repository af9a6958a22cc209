// kvcache io: parsing and validating a state (format.hpp) against a cache without
// touching it, driven by two tables: the header's field descriptors (header.hpp: each
// field's width, name and rule; the fingerprint's own table in fingerprint.hpp) and the
// sections after it (state_sections: counts, tokens and media, cell records, pruning
// table, K/V data, K padding, unique positions), each a function that reads its bytes
// and returns the first problem. Before both, check_envelope (magic, version, size,
// checksum). The result is a staged_state that commit.hpp applies.
#pragma once

#include <algorithm>  // std::sort, std::adjacent_find, std::max
#include <cstddef>    // std::byte, std::size_t
#include <cstdint>    // fixed-width integers
#include <cstring>    // std::memcpy
#include <limits>     // position limits
#include <optional>   // problems
#include <span>       // input bytes
#include <string>     // messages
#include <utility>    // std::pair
#include <vector>     // staging

#include "../cells/cell_table.hpp"
#include "../detail/policy_select.hpp"
#include "../error.hpp"
#include "../tokens/token.hpp"
#include "detail/xxhash.hpp"
#include "fingerprint.hpp"
#include "format.hpp"
#include "header.hpp"
#include "transfer.hpp"
#include "types.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace io {

namespace detail {

using kvcache::detail::internal_access;
using kvcache::detail::make_error;

/// A validated state, ready to be committed.
struct staged_state {
    state_kind kind = state_kind::whole_cache;
    seq_id_t saved_seq = -1;
    std::vector<token_t> tokens;
    std::vector<media_chunk> media;
    std::vector<pos_t> pos;         // per saved cell
    std::vector<std::int32_t> shift;
    std::vector<seq_set> seqs;
    std::vector<mrope_pos> ext;     // per saved cell with flags bit 1 (M-RoPE), else empty
    std::vector<std::pair<seq_id_t, pos_t>> pruning;  // (sequence in the cache, pruning point)
    const std::byte* data = nullptr;  // first byte of the K/V section
    std::uint64_t layer_bytes = 0;
};

/// The checks of a state's first bytes: magic, version, declared size against the `size`
/// bytes present. `head` holds the state's first min(size, state_header_size) bytes or
/// more. Returns the first problem, or nothing.
inline maybe_problem check_envelope_head(std::span<const std::byte> head, std::uint64_t size) {
    auto err = [](errc code, std::string msg) { return maybe_problem(parse_problem{code, std::move(msg)}); };
    if (size >= 4 && load_le<std::uint32_t>(head.data()) != state_magic)
        return err(errc::bad_magic, "magic is " + hex(load_le<std::uint32_t>(head.data())) + ", expected " +
                                        hex(state_magic) + " (\"KVST\"): not a kvcache state");
    if (size >= 8) {
        const auto v = load_le<std::uint32_t>(head.data() + off::version);
        if (v > state_version)
            return err(errc::unsupported_version, "format version " + std::to_string(v) +
                                                      " is newer than this library reads (version " +
                                                      std::to_string(state_version) + "); upgrade kvcache");
        if (v < state_version)
            return err(errc::unsupported_version, "format version " + std::to_string(v) +
                                                      " is older than the oldest this library reads (version " +
                                                      std::to_string(state_version) + "); save the state again");
    }
    if (size < state_header_size + state_checksum_size)
        return err(errc::truncated, "state is " + std::to_string(size) + " bytes, shorter than the " +
                                        std::to_string(state_header_size + state_checksum_size) +
                                        "-byte header and checksum");
    const auto total = load_le<std::uint64_t>(head.data() + off::total_size);
    if (total < state_header_size + state_checksum_size || size < total)
        return err(errc::truncated, "state declares " + std::to_string(total) + " bytes, got " + std::to_string(size));
    if (size > total)
        return err(errc::trailing_bytes, "state declares " + std::to_string(total) + " bytes, got " +
                                             std::to_string(size) + " (" + std::to_string(size - total) +
                                             " bytes after its end)");
    return std::nullopt;
}

/// The checks every state passes before its fields are read: check_envelope_head, then
/// the checksum. Returns the first problem, or nothing.
inline maybe_problem check_envelope(std::span<const std::byte> in) {
    if (auto bad = check_envelope_head(in, in.size())) return bad;
    const std::uint64_t size = in.size();
    const std::uint64_t stored = load_le<std::uint64_t>(in.data() + size - state_checksum_size);
    const std::uint64_t actual = checksum(in.first(static_cast<std::size_t>(size - state_checksum_size)));
    if (stored != actual)
        return parse_problem{errc::checksum_mismatch, "stored checksum " + hex(stored) + ", computed " + hex(actual)};
    return std::nullopt;
}

/// Cells a state of `kind` may fill: the capacity for a whole cache; for one sequence the
/// free cells plus the cells only `dst` uses (they are replaced).
template <class Cache>
std::uint64_t state_room(const Cache& cache, state_kind kind, seq_id_t dst) {
    const cell_table& ct = cache.cells();
    if (kind == state_kind::whole_cache) return ct.size();
    std::uint64_t room = ct.free_count();
    for (std::uint32_t c : ct.used_cells())
        if (ct.seqs(c).test(dst) && ct.seqs(c).count() == 1) ++room;
    return room;
}

/// The largest state a header with these counts can describe: every cell record with
/// n_seq_max sequence ids, a full pruning table. Nothing when it overflows 64 bits.
inline std::optional<std::uint64_t> state_size_bound(const state_header& h, std::uint32_t n_seq_max,
                                                     const layer_sizes& ls) {
    std::optional<std::uint64_t> n = state_header_size + state_checksum_size + 4 + std::uint64_t{8} * n_seq_max;
    auto add = [&](std::optional<std::uint64_t> v) { n = n && v ? add_u64(*n, *v) : std::nullopt; };
    add(mul_u64(h.n_tokens, 4));
    add(mul_u64(h.n_media, 16));
    add(mul_u64(h.n_cells, 24 + std::uint64_t{4} * n_seq_max));  // record + M-RoPE positions
    add(mul_u64(ls.layer, h.fp.n_layer));
    return n;
}

/// What can be checked from a state's first bytes alone, so that a file is refused before
/// it is read whole: the envelope's head, the header's fields and rules against `cache`,
/// n_cells against the room, and the declared size against the largest state the counts
/// can describe. `head` holds the first min(size, state_header_size) bytes.
template <class Cache>
maybe_problem check_state_head(const Cache& cache, std::span<const std::byte> head, std::uint64_t size,
                               state_kind want, seq_id_t dst, const load_options& opt) {
    if (auto bad = check_envelope_head(head, size)) return bad;
    byte_reader r(head.first(state_header_size));
    r.take(off::kind);
    const state_header h = read_header(r);
    if (auto bad = check_header(h, header_expect{want, fingerprint_of(cache), opt.max_tokens})) return bad;
    const std::uint64_t room = state_room(cache, want, dst);
    if (h.n_cells > room)
        return parse_problem{errc::no_space, "n_cells = " + std::to_string(h.n_cells) + " exceeds " +
                                                 (want == state_kind::one_sequence ? "the free cells " : "the capacity ") +
                                                 std::to_string(room)};
    const auto ls = sizes_for(h.fp, h.n_cells);
    const auto bound = ls ? state_size_bound(h, cache.shape().n_seq_max, *ls) : std::nullopt;
    if (!bound || size > *bound)
        return parse_problem{errc::trailing_bytes,
                             "state declares " + std::to_string(size) + " bytes; its counts (n_tokens = " +
                                 std::to_string(h.n_tokens) + ", n_media = " + std::to_string(h.n_media) +
                                 ", n_cells = " + std::to_string(h.n_cells) + ") describe at most " +
                                 (bound ? std::to_string(*bound) : std::string("2^64")) + " bytes"};
    return std::nullopt;
}

/// What the sections of a state are read into and checked against.
template <class Cache>
struct parse_context {
    const Cache& cache;
    byte_reader r;         // positioned after the header
    state_header h;
    seq_id_t dst;          // where a one-sequence state's cells go
    staged_state st;
    layer_sizes ls{};
    [[nodiscard]] bool one_seq() const noexcept { return st.kind == state_kind::one_sequence; }
    [[nodiscard]] std::uint32_t n_seq_max() const noexcept { return cache.shape().n_seq_max; }
};

namespace sections {

inline maybe_problem fail(errc code, std::string msg) { return parse_problem{code, std::move(msg)}; }

/// Counts against the bytes present and the room in the cache (checked products).
template <class Cache>
maybe_problem counts(parse_context<Cache>& c) {
    const state_header& h = c.h;
    const auto tok_bytes = mul_u64(h.n_tokens, 4);
    if (!tok_bytes || !c.r.has(*tok_bytes))
        return fail(errc::truncated, "n_tokens = " + std::to_string(h.n_tokens) + " needs " +
                                         (tok_bytes ? std::to_string(*tok_bytes) : std::string("more than 2^64")) +
                                         " bytes, " + std::to_string(c.r.left()) + " left");
    const auto media_bytes = mul_u64(h.n_media, 16);
    if (!media_bytes || !c.r.has(*tok_bytes + *media_bytes))  // sum <= 5 * n_tokens * 4: no overflow
        return fail(errc::truncated, "n_media = " + std::to_string(h.n_media) + " needs more bytes than the " +
                                         std::to_string(c.r.left() - *tok_bytes) + " left");
    const std::uint64_t room = state_room(c.cache, c.st.kind, c.dst);
    if (h.n_cells > room)
        return fail(errc::no_space, "n_cells = " + std::to_string(h.n_cells) + " exceeds " +
                                        (c.one_seq() ? "the free cells " : "the capacity ") + std::to_string(room));
    const auto ls = sizes_for(c.h.fp, h.n_cells);
    if (!ls) return fail(errc::truncated, "n_cells = " + std::to_string(h.n_cells) + ": data size overflows 2^64");
    c.ls = *ls;
    return std::nullopt;
}

/// The token list and its media chunks (F18 rules).
template <class Cache>
maybe_problem tokens(parse_context<Cache>& c) {
    staged_state& st = c.st;
    byte_reader& r = c.r;
    const auto tok_bytes = static_cast<std::size_t>(c.h.n_tokens * 4);  // counts() checked it fits
    st.tokens.resize(static_cast<std::size_t>(c.h.n_tokens));
    if (tok_bytes != 0)  // memcpy needs non-null pointers even for 0 bytes
        std::memcpy(st.tokens.data(), r.take(tok_bytes), tok_bytes);
    st.media.resize(static_cast<std::size_t>(c.h.n_media));
    for (auto& m : st.media) {
        m.id = r.get<std::uint64_t>();
        m.begin = r.get<std::uint32_t>();
        m.n_pos = r.get<std::uint32_t>();
    }
    if (auto bad = check_tokens(st.tokens, st.media)) return fail(errc::invalid_cell, *bad);
    return std::nullopt;
}

/// The cell records: position, pending shift, sequence ids.
template <class Cache>
maybe_problem cells(parse_context<Cache>& c) {
    staged_state& st = c.st;
    byte_reader& r = c.r;
    const auto n = static_cast<std::size_t>(c.h.n_cells);
    st.pos.resize(n);
    st.shift.resize(n);
    st.seqs.resize(n);
    const std::uint32_t n_seq_max = c.n_seq_max();
    const std::uint32_t max_seq = c.one_seq() ? 1 : n_seq_max;
    for (std::size_t i = 0; i < n; ++i) {
        const std::string cell = "cell " + std::to_string(i);
        if (!r.has(12)) return fail(errc::truncated, cell + ": record needs 12 bytes, " + std::to_string(r.left()) + " left");
        st.pos[i] = r.get<std::int32_t>();
        st.shift[i] = r.get<std::int32_t>();
        const auto n_seq = r.get<std::uint32_t>();
        if (st.pos[i] < 0) return fail(errc::invalid_cell, cell + ": pos = " + std::to_string(st.pos[i]) + ", must be >= 0");
        const std::int64_t origin = std::int64_t{st.pos[i]} - st.shift[i];
        if (origin < 0 || origin > std::numeric_limits<pos_t>::max())
            return fail(errc::invalid_cell, cell + ": pos " + std::to_string(st.pos[i]) + " with shift " +
                                                std::to_string(st.shift[i]) + " puts its K at position " +
                                                std::to_string(origin) + ", outside [0, 2^31)");
        if (!Cache::layout::can_shift && st.shift[i] != 0)
            return fail(errc::invalid_cell, cell + ": shift = " + std::to_string(st.shift[i]) + " but the " +
                                                std::string(Cache::layout::name) + " layout cannot shift");
        if (n_seq == 0 || n_seq > max_seq)
            return fail(errc::invalid_cell, cell + ": holds " + std::to_string(n_seq) + " sequences, must be in [1, " +
                                                std::to_string(max_seq) + "]");
        if (!r.has(std::uint64_t{n_seq} * 4))
            return fail(errc::truncated, cell + ": " + std::to_string(n_seq) + " sequence ids need " +
                                             std::to_string(std::uint64_t{n_seq} * 4) + " bytes, " +
                                             std::to_string(r.left()) + " left");
        seq_id_t prev = -1;
        for (std::uint32_t k = 0; k < n_seq; ++k) {
            const auto s = r.get<std::int32_t>();
            if (c.one_seq()) {
                if (s != st.saved_seq)
                    return fail(errc::invalid_cell, cell + ": sequence " + std::to_string(s) +
                                                        ", a one-sequence state holds only sequence " +
                                                        std::to_string(st.saved_seq));
                st.seqs[i].set(c.dst);
                continue;
            }
            if (s < 0 || static_cast<std::uint32_t>(s) >= n_seq_max)
                return fail(errc::invalid_cell, cell + ": sequence id " + std::to_string(s) + " outside [0, " +
                                                    std::to_string(n_seq_max) + ")");
            if (s <= prev)
                return fail(errc::invalid_cell, cell + ": sequence ids not strictly increasing (" +
                                                    std::to_string(prev) + " then " + std::to_string(s) + ")");
            st.seqs[i].set(s);
            prev = s;
        }
    }
    return std::nullopt;
}

/// The M-RoPE positions (flags bit 1): present exactly when the cache has M-RoPE sections.
template <class Cache>
maybe_problem mrope(parse_context<Cache>& c) {
    const bool want = c.cache.shape().rope.mrope.on();
    const bool has = (c.h.flags & state_flag_mrope) != 0;
    if (has != want)
        return fail(errc::invalid_cell, has ? std::string("flags bit 1: the state holds M-RoPE positions but the cache's "
                                                          "rope.mrope has no sections")
                                            : std::string("flags bit 1 is clear: the cache has M-RoPE sections "
                                                          "(rope.mrope) but the state holds no M-RoPE positions"));
    if (!has) return std::nullopt;
    byte_reader& r = c.r;
    const auto n = static_cast<std::size_t>(c.h.n_cells);
    if (!r.has(std::uint64_t{n} * 12))
        return fail(errc::truncated, "M-RoPE positions of " + std::to_string(n) + " cells need " +
                                         std::to_string(std::uint64_t{n} * 12) + " bytes, " +
                                         std::to_string(r.left()) + " left");
    c.st.ext.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
        mrope_pos& e = c.st.ext[i];
        e.h = r.get<std::int32_t>();
        e.w = r.get<std::int32_t>();
        e.e = r.get<std::int32_t>();
        if (e.h < 0 || e.w < 0 || e.e < 0)
            return fail(errc::invalid_cell, "cell " + std::to_string(i) + ": M-RoPE positions (" +
                                                std::to_string(e.h) + ", " + std::to_string(e.w) + ", " +
                                                std::to_string(e.e) + "), each must be >= 0");
    }
    return std::nullopt;
}

/// The optional table of ring pruning points (flags bit 0).
template <class Cache>
maybe_problem pruning(parse_context<Cache>& c) {
    if ((c.h.flags & state_flag_pruning) == 0) return std::nullopt;
    staged_state& st = c.st;
    byte_reader& r = c.r;
    if (!r.has(4)) return fail(errc::truncated, "pruning table: count needs 4 bytes, " + std::to_string(r.left()) + " left");
    const auto n_pruned = r.get<std::uint32_t>();
    const std::uint32_t n_seq_max = c.n_seq_max();
    const std::uint32_t max_entries = c.one_seq() ? 1 : n_seq_max;
    if (n_pruned == 0 || n_pruned > max_entries)
        return fail(errc::invalid_cell, "pruning table holds " + std::to_string(n_pruned) +
                                            " sequences, must be in [1, " + std::to_string(max_entries) + "]");
    if (!r.has(std::uint64_t{n_pruned} * 8))
        return fail(errc::truncated, "pruning table: " + std::to_string(n_pruned) + " entries need " +
                                         std::to_string(std::uint64_t{n_pruned} * 8) + " bytes, " +
                                         std::to_string(r.left()) + " left");
    std::vector<pos_t> top(n_seq_max, -1);  // largest saved position per sequence (in the cache's ids)
    for (std::size_t i = 0; i < st.pos.size(); ++i) st.seqs[i].for_each([&](seq_id_t s) {
        top[static_cast<std::size_t>(s)] = std::max(top[static_cast<std::size_t>(s)], st.pos[i]);
    });
    seq_id_t prev = -1;
    for (std::uint32_t k = 0; k < n_pruned; ++k) {
        const auto s = r.get<std::int32_t>();
        const auto w = r.get<std::int32_t>();
        const std::string entry = "pruning table entry " + std::to_string(k) + ": ";
        if (c.one_seq() ? s != st.saved_seq : s < 0 || static_cast<std::uint32_t>(s) >= n_seq_max || s <= prev)
            return fail(errc::invalid_cell, entry + "sequence " + std::to_string(s) +
                                                (c.one_seq() ? ", a one-sequence state holds only sequence " +
                                                                   std::to_string(st.saved_seq)
                                                             : " out of [0, " + std::to_string(n_seq_max) +
                                                                   ") or not above the previous entry's"));
        prev = s;
        const seq_id_t in_cache = c.one_seq() ? c.dst : s;
        const pos_t last = top[static_cast<std::size_t>(in_cache)];
        if (last < 0) return fail(errc::invalid_cell, entry + "sequence " + std::to_string(s) + " holds no cell");
        if (w < 1 || std::int64_t{w} > std::int64_t{last} + 1)
            return fail(errc::invalid_cell, entry + "pruned_below = " + std::to_string(w) + ", must be in [1, " +
                                                std::to_string(std::int64_t{last} + 1) +
                                                "] (the sequence's largest position + 1)");
        st.pruning.emplace_back(in_cache, w);
    }
    return std::nullopt;
}

/// The K/V section: exactly the bytes left before the checksum.
template <class Cache>
maybe_problem kv_data(parse_context<Cache>& c) {
    const fingerprint& f = c.h.fp;
    const auto data_bytes = mul_u64(c.ls.layer, f.n_layer);
    if (!data_bytes || *data_bytes > c.r.left())
        return fail(errc::truncated, "K/V data of " + std::to_string(c.h.n_cells) + " cells needs " +
                                         (data_bytes ? std::to_string(*data_bytes) : std::string("more than 2^64")) +
                                         " bytes, " + std::to_string(c.r.left()) + " left");
    if (*data_bytes < c.r.left())
        return fail(errc::trailing_bytes, std::to_string(c.r.left() - *data_bytes) +
                                              " bytes between the K/V data and the checksum");
    c.st.layer_bytes = c.ls.layer;
    c.st.data = c.r.take(static_cast<std::size_t>(*data_bytes));
    return std::nullopt;
}

/// Lanes past n_cells in the last K tile are zero in every state the saver writes.
template <class Cache>
maybe_problem k_padding(parse_context<Cache>& c) {
    const fingerprint& f = c.h.fp;
    const auto n = static_cast<std::size_t>(c.h.n_cells);
    constexpr std::uint32_t w = state_k_lanes;
    const std::uint32_t tail = static_cast<std::uint32_t>(n % w);
    if (tail == 0) return std::nullopt;
    const std::size_t es = elem_unit_bytes(f.elem_size);
    const std::uint32_t rows = f.head_dim_k / elem_unit_values(f.elem_size);  // (units for block elements)
    const std::size_t tile_bytes = std::size_t{w} * rows * es;
    for (std::uint32_t l = 0; l < f.n_layer; ++l)
        for (std::uint32_t h = 0; h < f.n_head_kv; ++h) {
            const std::byte* last = c.st.data + l * c.ls.layer + h * c.ls.k_head + c.ls.k_head - tile_bytes;
            for (std::uint32_t d = 0; d < rows; ++d)
                for (std::size_t b = (d * std::size_t{w} + tail) * es; b < (d + 1) * std::size_t{w} * es; ++b)
                    if (last[b] != std::byte{0})
                        return fail(errc::invalid_cell, "layer " + std::to_string(l) + " head " + std::to_string(h) +
                                                            ": K padding lanes past cell " + std::to_string(n) +
                                                            " are not zero");
        }
    return std::nullopt;
}

/// A layout that cannot move positions never holds one (sequence, position) twice;
/// seq_add / seq_div can legitimately produce duplicates in the others.
template <class Cache>
maybe_problem unique_positions(parse_context<Cache>& c) {
    if constexpr (!Cache::layout::can_shift) {
        std::vector<std::pair<seq_id_t, pos_t>> pairs;
        for (std::size_t i = 0; i < c.st.pos.size(); ++i)
            c.st.seqs[i].for_each([&](seq_id_t s) { pairs.emplace_back(s, c.st.pos[i]); });
        std::sort(pairs.begin(), pairs.end());
        const auto dup = std::adjacent_find(pairs.begin(), pairs.end());
        if (dup != pairs.end())
            return fail(errc::invalid_cell, "sequence " + std::to_string(dup->first) + " holds position " +
                                                std::to_string(dup->second) + " twice");
    }
    return std::nullopt;
}

}  // namespace sections

/// The sections after the header, in file order: each reads its bytes (or checks what
/// earlier ones read) and returns the first problem.
template <class Cache>
inline constexpr maybe_problem (*state_sections[])(parse_context<Cache>&) = {
    &sections::counts<Cache>,  &sections::tokens<Cache>,  &sections::cells<Cache>, &sections::mrope<Cache>, &sections::pruning<Cache>,
    &sections::kv_data<Cache>, &sections::k_padding<Cache>, &sections::unique_positions<Cache>,
};

/// Parses and validates `in` against `cache` without touching it: the envelope, then
/// the header (header.hpp's table of fields and rules), then state_sections in order.
/// For kind one_sequence, `dst` is the sequence the cells will belong to.
template <class Cache>
result<staged_state> parse_state(const char* fn, const Cache& cache, std::span<const std::byte> in,
                                 state_kind want, seq_id_t dst, const load_options& opt) {
    auto err = [&](const parse_problem& p) -> result<staged_state> {
        return make_error(p.code, std::string(fn) + ": " + p.msg);
    };
    if (auto bad = check_envelope(in)) return err(*bad);
    byte_reader r(in.first(static_cast<std::size_t>(in.size() - state_checksum_size)));
    r.take(off::kind);
    const state_header h = read_header(r);
    parse_context<Cache> c{cache, r, h, dst, {}, {}};  // r: after the header
    if (auto bad = check_header(c.h, header_expect{want, fingerprint_of(cache), opt.max_tokens})) return err(*bad);
    c.st.kind = static_cast<state_kind>(c.h.kind);
    c.st.saved_seq = c.h.seq;
    for (auto* section : state_sections<Cache>)
        if (auto bad = section(c)) return err(*bad);
    return std::move(c.st);
}

}  // namespace detail

}  // namespace io
KVCACHE_END_NAMESPACE
