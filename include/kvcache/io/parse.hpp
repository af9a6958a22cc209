// kvcache io: parsing and validating a state (format.hpp) against a cache without
// touching it. The stages: the envelope (magic, version, size, checksum:
// check_envelope), the header (kind, flags, the fingerprint checked field by field from
// the descriptor table of fingerprint.hpp, counts), tokens and media, cell records, the
// pruning table, the K/V section. The result is a staged_state that commit.hpp applies.
#pragma once

#include <algorithm>  // std::sort, std::adjacent_find, std::max
#include <cstddef>    // std::byte, std::size_t
#include <cstdint>    // fixed-width integers
#include <cstring>    // std::memcpy
#include <limits>     // position limits
#include <optional>   // envelope problems
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
    std::vector<std::pair<seq_id_t, pos_t>> pruning;  // (sequence in the cache, pruning point)
    const std::byte* data = nullptr;  // first byte of the K/V section
    std::uint64_t layer_bytes = 0;
};

/// The checks every state passes before its fields are read: magic, version, declared
/// size against the bytes present, checksum. Returns the first problem, or nothing.
inline std::optional<std::pair<errc, std::string>> check_envelope(std::span<const std::byte> in) {
    auto err = [](errc code, std::string msg) { return std::optional<std::pair<errc, std::string>>({code, std::move(msg)}); };
    const std::uint64_t size = in.size();
    if (size >= 4 && load_le<std::uint32_t>(in.data()) != state_magic)
        return err(errc::bad_magic, "magic is " + hex(load_le<std::uint32_t>(in.data())) + ", expected " +
                                        hex(state_magic) + " (\"KVST\"): not a kvcache state");
    if (size >= 8) {
        const auto v = load_le<std::uint32_t>(in.data() + off::version);
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
    const auto total = load_le<std::uint64_t>(in.data() + off::total_size);
    if (total < state_header_size + state_checksum_size || size < total)
        return err(errc::truncated, "state declares " + std::to_string(total) + " bytes, got " + std::to_string(size));
    if (size > total)
        return err(errc::trailing_bytes, "state declares " + std::to_string(total) + " bytes, got " +
                                             std::to_string(size) + " (" + std::to_string(size - total) +
                                             " bytes after its end)");
    const std::uint64_t stored = load_le<std::uint64_t>(in.data() + size - state_checksum_size);
    const std::uint64_t actual = checksum(in.first(static_cast<std::size_t>(size - state_checksum_size)));
    if (stored != actual)
        return err(errc::checksum_mismatch, "stored checksum " + hex(stored) + ", computed " + hex(actual));

    return std::nullopt;
}

/// Parses and validates `in` against `cache` without touching it. For kind
/// one_sequence, `dst` is the sequence the cells will belong to.
template <class Cache>
result<staged_state> parse_state(const char* fn, const Cache& cache, std::span<const std::byte> in,
                                 state_kind want, seq_id_t dst, const load_options& opt) {
    const std::string who = std::string(fn) + ": ";
    auto err = [&](errc code, const std::string& msg) -> result<staged_state> { return make_error(code, who + msg); };
    if (auto bad = check_envelope(in)) return err(bad->first, bad->second);
    const std::uint64_t size = in.size();
    byte_reader r(in.first(static_cast<std::size_t>(size - state_checksum_size)));
    r.take(off::kind);
    const auto kind = r.get<std::uint32_t>();
    const auto flags = r.get<std::uint32_t>();
    if (kind > 1) return err(errc::unsupported, "state kind " + std::to_string(kind) + " unknown (0 or 1)");
    if (kind != static_cast<std::uint32_t>(want))
        return err(errc::unsupported, kind == 0 ? "the bytes hold a whole cache; use load_state"
                                                : "the bytes hold one sequence; use load_seq");
    if ((flags & ~state_flag_pruning) != 0)
        return err(errc::unsupported, "flags = " + hex(flags) + ", version 1 defines only bit 0 (pruning table)");

    const fingerprint f = fingerprint_of(cache);
    for (const fp_field& d : fingerprint_fields) {  // the table of fingerprint.hpp, in header order
        const auto got = r.get<std::uint32_t>();
        const std::uint32_t want_v = f.*d.member;
        if (d.rule == fp_rule::informational) continue;
        if (d.rule == fp_rule::window && (want_v == 0 || got == 0)) continue;
        if (got != want_v)
            return err(d.code, std::string(d.name) + " = " + std::to_string(got) + " in the state, the cache has " +
                                   std::to_string(want_v));
    }
    staged_state st;
    st.kind = static_cast<state_kind>(kind);
    st.saved_seq = r.get<std::int32_t>();
    if (const auto got = r.get<std::uint32_t>(); got != f.*rope_ext_field.member)  // rope scaling word
        return err(rope_ext_field.code, std::string(rope_ext_field.name) + " = " + hex(got) +
                                            " in the state, the cache has " + hex(f.*rope_ext_field.member) +
                                            " (0 = plain RoPE): saved with other RoPE scaling (rope_params "
                                            "ntk_alpha, attn_factor, scaling, n_ctx_orig, yarn, llama3, factor tables)");
    if (st.kind == state_kind::whole_cache ? st.saved_seq != -1 : st.saved_seq < 0)
        return err(errc::invalid_cell, "seq = " + std::to_string(st.saved_seq) +
                                           (st.kind == state_kind::whole_cache ? ", must be -1 for a whole cache"
                                                                               : ", must be >= 0"));
    const auto n_tokens = r.get<std::uint64_t>();
    const auto n_media = r.get<std::uint64_t>();
    const auto n_cells = r.get<std::uint64_t>();

    // Counts: against limits first, then against the bytes present (checked products).
    if (n_tokens > opt.max_tokens)
        return err(errc::no_space, "n_tokens = " + std::to_string(n_tokens) + " exceeds the limit " +
                                       std::to_string(opt.max_tokens) + " (load_options.max_tokens)");
    const auto tok_bytes = mul_u64(n_tokens, 4);
    if (!tok_bytes || !r.has(*tok_bytes))
        return err(errc::truncated, "n_tokens = " + std::to_string(n_tokens) + " needs " +
                                        (tok_bytes ? std::to_string(*tok_bytes) : std::string("more than 2^64")) +
                                        " bytes, " + std::to_string(r.left()) + " left");
    if (n_media > n_tokens)
        return err(errc::invalid_cell, "n_media = " + std::to_string(n_media) + " exceeds n_tokens = " +
                                           std::to_string(n_tokens) + " (each chunk covers a position)");
    const auto media_bytes = mul_u64(n_media, 16);
    if (!media_bytes || !r.has(*tok_bytes + *media_bytes))  // sum <= 5 * n_tokens * 4: no overflow
        return err(errc::truncated, "n_media = " + std::to_string(n_media) + " needs more bytes than the " +
                                        std::to_string(r.left() - *tok_bytes) + " left");
    const cell_table& ct = cache.cells();
    std::uint64_t room = ct.size();
    if (st.kind == state_kind::one_sequence) {  // free cells + cells only dst uses (they are replaced)
        room = ct.free_count();
        for (std::uint32_t c : ct.used_cells())
            if (ct.seqs(c).test(dst) && ct.seqs(c).count() == 1) ++room;
    }
    if (n_cells > room)
        return err(errc::no_space, "n_cells = " + std::to_string(n_cells) + " exceeds " +
                                       (st.kind == state_kind::whole_cache ? "the capacity " : "the free cells ") +
                                       std::to_string(room));
    const auto ls = sizes_for(f, n_cells);
    if (!ls) return err(errc::truncated, "n_cells = " + std::to_string(n_cells) + ": data size overflows 2^64");

    st.tokens.resize(static_cast<std::size_t>(n_tokens));
    if (n_tokens != 0)  // memcpy needs non-null pointers even for 0 bytes
        std::memcpy(st.tokens.data(), r.take(static_cast<std::size_t>(*tok_bytes)), static_cast<std::size_t>(*tok_bytes));
    st.media.resize(static_cast<std::size_t>(n_media));
    for (auto& m : st.media) {
        m.id = r.get<std::uint64_t>();
        m.begin = r.get<std::uint32_t>();
        m.n_pos = r.get<std::uint32_t>();
    }
    if (auto bad = check_tokens(st.tokens, st.media)) return err(errc::invalid_cell, *bad);

    constexpr bool can_shift = Cache::layout::can_shift;
    const auto n = static_cast<std::size_t>(n_cells);
    st.pos.resize(n);
    st.shift.resize(n);
    st.seqs.resize(n);
    const std::uint32_t n_seq_max = cache.shape().n_seq_max;
    for (std::size_t i = 0; i < n; ++i) {
        const std::string cell = "cell " + std::to_string(i);
        if (!r.has(12)) return err(errc::truncated, cell + ": record needs 12 bytes, " + std::to_string(r.left()) + " left");
        st.pos[i] = r.get<std::int32_t>();
        st.shift[i] = r.get<std::int32_t>();
        const auto n_seq = r.get<std::uint32_t>();
        if (st.pos[i] < 0) return err(errc::invalid_cell, cell + ": pos = " + std::to_string(st.pos[i]) + ", must be >= 0");
        const std::int64_t origin = std::int64_t{st.pos[i]} - st.shift[i];
        if (origin < 0 || origin > std::numeric_limits<pos_t>::max())
            return err(errc::invalid_cell, cell + ": pos " + std::to_string(st.pos[i]) + " with shift " +
                                               std::to_string(st.shift[i]) + " puts its K at position " +
                                               std::to_string(origin) + ", outside [0, 2^31)");
        if (!can_shift && st.shift[i] != 0)
            return err(errc::invalid_cell, cell + ": shift = " + std::to_string(st.shift[i]) + " but the " +
                                               std::string(Cache::layout::name) + " layout cannot shift");
        const std::uint32_t max_seq = st.kind == state_kind::whole_cache ? n_seq_max : 1;
        if (n_seq == 0 || n_seq > max_seq)
            return err(errc::invalid_cell, cell + ": holds " + std::to_string(n_seq) + " sequences, must be in [1, " +
                                               std::to_string(max_seq) + "]");
        if (!r.has(std::uint64_t{n_seq} * 4))
            return err(errc::truncated, cell + ": " + std::to_string(n_seq) + " sequence ids need " +
                                            std::to_string(std::uint64_t{n_seq} * 4) + " bytes, " +
                                            std::to_string(r.left()) + " left");
        seq_id_t prev = -1;
        for (std::uint32_t k = 0; k < n_seq; ++k) {
            const auto s = r.get<std::int32_t>();
            if (st.kind == state_kind::one_sequence) {
                if (s != st.saved_seq)
                    return err(errc::invalid_cell, cell + ": sequence " + std::to_string(s) +
                                                       ", a one-sequence state holds only sequence " +
                                                       std::to_string(st.saved_seq));
                st.seqs[i].set(dst);
                continue;
            }
            if (s < 0 || static_cast<std::uint32_t>(s) >= n_seq_max)
                return err(errc::invalid_cell, cell + ": sequence id " + std::to_string(s) + " outside [0, " +
                                                   std::to_string(n_seq_max) + ")");
            if (s <= prev)
                return err(errc::invalid_cell, cell + ": sequence ids not strictly increasing (" +
                                                   std::to_string(prev) + " then " + std::to_string(s) + ")");
            st.seqs[i].set(s);
            prev = s;
        }
    }
    if ((flags & state_flag_pruning) != 0) {
        if (!r.has(4)) return err(errc::truncated, "pruning table: count needs 4 bytes, " + std::to_string(r.left()) + " left");
        const auto n_pruned = r.get<std::uint32_t>();
        const std::uint32_t max_entries = st.kind == state_kind::whole_cache ? n_seq_max : 1;
        if (n_pruned == 0 || n_pruned > max_entries)
            return err(errc::invalid_cell, "pruning table holds " + std::to_string(n_pruned) +
                                               " sequences, must be in [1, " + std::to_string(max_entries) + "]");
        if (!r.has(std::uint64_t{n_pruned} * 8))
            return err(errc::truncated, "pruning table: " + std::to_string(n_pruned) + " entries need " +
                                            std::to_string(std::uint64_t{n_pruned} * 8) + " bytes, " +
                                            std::to_string(r.left()) + " left");
        std::vector<pos_t> top(n_seq_max, -1);  // largest saved position per sequence (in the cache's ids)
        for (std::size_t i = 0; i < n; ++i) st.seqs[i].for_each([&](seq_id_t s) {
            top[static_cast<std::size_t>(s)] = std::max(top[static_cast<std::size_t>(s)], st.pos[i]);
        });
        seq_id_t prev = -1;
        for (std::uint32_t k = 0; k < n_pruned; ++k) {
            const auto s = r.get<std::int32_t>();
            const auto w = r.get<std::int32_t>();
            const std::string entry = "pruning table entry " + std::to_string(k) + ": ";
            if (st.kind == state_kind::one_sequence ? s != st.saved_seq
                                                    : s < 0 || static_cast<std::uint32_t>(s) >= n_seq_max || s <= prev)
                return err(errc::invalid_cell, entry + "sequence " + std::to_string(s) +
                                                   (st.kind == state_kind::one_sequence
                                                        ? ", a one-sequence state holds only sequence " +
                                                              std::to_string(st.saved_seq)
                                                        : " out of [0, " + std::to_string(n_seq_max) +
                                                              ") or not above the previous entry's"));
            prev = s;
            const seq_id_t in_cache = st.kind == state_kind::one_sequence ? dst : s;
            const pos_t last = top[static_cast<std::size_t>(in_cache)];
            if (last < 0) return err(errc::invalid_cell, entry + "sequence " + std::to_string(s) + " holds no cell");
            if (w < 1 || std::int64_t{w} > std::int64_t{last} + 1)
                return err(errc::invalid_cell, entry + "pruned_below = " + std::to_string(w) + ", must be in [1, " +
                                                   std::to_string(std::int64_t{last} + 1) +
                                                   "] (the sequence's largest position + 1)");
            st.pruning.emplace_back(in_cache, w);
        }
    }
    const auto data_bytes = mul_u64(ls->layer, f.n_layer);
    if (!data_bytes || *data_bytes > r.left())
        return err(errc::truncated, "K/V data of " + std::to_string(n_cells) + " cells needs " +
                                        (data_bytes ? std::to_string(*data_bytes) : std::string("more than 2^64")) +
                                        " bytes, " + std::to_string(r.left()) + " left");
    if (*data_bytes < r.left())
        return err(errc::trailing_bytes, std::to_string(r.left() - *data_bytes) +
                                             " bytes between the K/V data and the checksum");
    st.layer_bytes = ls->layer;
    st.data = r.take(static_cast<std::size_t>(*data_bytes));

    // Lanes past n_cells in the last K tile are zero in every state the saver writes.
    constexpr std::uint32_t w = state_k_lanes;
    const std::uint32_t tail = static_cast<std::uint32_t>(n % w);
    if (tail != 0) {
        const std::size_t es = f.elem_size;
        const std::size_t tile_bytes = std::size_t{w} * f.head_dim_k * es;
        for (std::uint32_t l = 0; l < f.n_layer; ++l)
            for (std::uint32_t h = 0; h < f.n_head_kv; ++h) {
                const std::byte* last = st.data + l * ls->layer + h * ls->k_head + ls->k_head - tile_bytes;
                for (std::uint32_t d = 0; d < f.head_dim_k; ++d)
                    for (std::size_t b = (d * std::size_t{w} + tail) * es; b < (d + 1) * std::size_t{w} * es; ++b)
                        if (last[b] != std::byte{0})
                            return err(errc::invalid_cell, "layer " + std::to_string(l) + " head " + std::to_string(h) +
                                                               ": K padding lanes past cell " + std::to_string(n) +
                                                               " are not zero");
            }
    }

    // A layout that cannot move positions never holds one (sequence, position) twice;
    // seq_add / seq_div can legitimately produce duplicates in the others.
    if constexpr (!can_shift) {
        std::vector<std::pair<seq_id_t, pos_t>> pairs;
        for (std::size_t i = 0; i < n; ++i) st.seqs[i].for_each([&](seq_id_t s) { pairs.emplace_back(s, st.pos[i]); });
        std::sort(pairs.begin(), pairs.end());
        const auto dup = std::adjacent_find(pairs.begin(), pairs.end());
        if (dup != pairs.end())
            return err(errc::invalid_cell, "sequence " + std::to_string(dup->first) + " holds position " +
                                               std::to_string(dup->second) + " twice");
    }
    return st;
}

}  // namespace detail

}  // namespace io
KVCACHE_END_NAMESPACE
