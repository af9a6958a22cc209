// kvcache: saving and loading memory state (F15): a whole memory or one sequence, to
// bytes or to a session file (io/session.hpp, included at the end). The single-cache
// format is described in io/format.hpp, the composite one (iswa_cache) in io/composite.hpp.
//
// Loading never trusts its input: it parses and validates everything (sizes,
// checksum, model fingerprint, counts against capacity, every cell and token) into
// staging first, and only then changes the memory. On any failure the result carries
// a specific errc with expected-versus-actual values and the memory is unchanged. For
// a composite memory every part is parsed and validated, and every part's cells chosen,
// before any part's K/V is written: a bad second part leaves the first part unchanged.
//
//     auto bytes = kvcache::io::save_seq(cache, 0, tokens);       // std::vector<std::byte>
//     auto r = kvcache::io::load_seq(other_cache, 3, bytes);       // into sequence 3
//     if (!r) std::fprintf(stderr, "%s\n", r.message().c_str());  // cache untouched
//
// Host-argument errors (a sequence id out of range, placements staged, an output
// span of the wrong size) throw kvcache::error like the rest of the library.
//
// The implementation, bottom up: detail/xxhash.hpp (the only xxHash include),
// fingerprint.hpp (fingerprint and its field table, token rules), transfer.hpp (K/V
// between storage and format), write.hpp (saving), parse.hpp (validation into staging),
// commit.hpp (applying a staged state), composite.hpp (composite header), this file (the
// public API) and session.hpp (files).
#pragma once

#include <cstddef>  // std::byte, std::size_t
#include <cstdint>  // fixed-width integers
#include <span>     // inputs and outputs
#include <string>   // messages
#include <utility>  // std::move
#include <vector>   // buffers and staging

#include "../detail/policy_select.hpp"
#include "../error.hpp"
#include "../memory/memory.hpp"
#include "../tokens/token.hpp"
#include "commit.hpp"
#include "composite.hpp"
#include "detail/xxhash.hpp"
#include "fingerprint.hpp"
#include "format.hpp"
#include "parse.hpp"
#include "types.hpp"
#include "write.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace io {

namespace detail {

/// What a composite memory's state must say of it (composite.hpp).
template <class M>
composite_expect expect_of(const M& m, state_kind kind) {
    composite_expect e{kind, 0, 0, {}};
    if constexpr (requires { M::composite_id; }) e.composite_kind = static_cast<std::uint32_t>(M::composite_id);
    if constexpr (requires { M::window; }) e.window = static_cast<std::uint32_t>(M::window);
    m.for_each_part([&](const auto& part) {
        e.parts.push_back({layout_window(part), part.shape().n_layer, 0});
    });
    return e;
}

/// Part sizes of a composite memory's state (the prompt goes with part 0).
template <class M>
std::vector<std::size_t> composite_part_sizes(const M& m, seq_id_t seq, std::span<const token_t> tokens,
                                              std::span<const media_chunk> media) {
    std::vector<std::size_t> sizes;
    m.for_each_part([&](const auto& part) {
        const bool first = sizes.empty();
        const auto t = first ? tokens : std::span<const token_t>{};
        const auto md = first ? media : std::span<const media_chunk>{};
        const auto cells = cells_to_save(part, seq);
        sizes.push_back(state_bytes(part, cells, seq, t.size(), md.size()));
    });
    return sizes;
}

/// Writes a composite memory's state into out (sized by composite_part_sizes).
template <class M>
void write_composite(const M& m, seq_id_t seq, std::span<const token_t> tokens, std::span<const media_chunk> media,
                     std::span<const std::size_t> sizes, std::span<std::byte> out) {
    std::size_t at = write_composite_header(out, expect_of(m, seq < 0 ? state_kind::whole_cache
                                                                      : state_kind::one_sequence), sizes);
    std::size_t i = 0;
    m.for_each_part([&](const auto& part) {
        const auto t = i == 0 ? tokens : std::span<const token_t>{};
        const auto md = i == 0 ? media : std::span<const media_chunk>{};
        const auto cells = cells_to_save(part, seq);
        write_state(part, cells, seq, t, md, out.subspan(at, sizes[i]));
        at += sizes[i];
        ++i;
    });
    write_composite_checksum(out);
}

/// Loads a composite memory's state: parses every part into staging, lets every part's
/// layout choose its cells (rolling back the earlier parts if one refuses), and only then
/// writes cells and K/V into every part. The load_info is part 0's (it holds the prompt).
template <class M>
result<load_info> load_composite(const char* fn, M& m, std::span<const std::byte> bytes, state_kind kind,
                                 seq_id_t dst, const load_options& opt) {
    auto parts = parse_composite(fn, bytes, expect_of(m, kind));
    if (!parts) return make_error(parts.code(), parts.message());
    std::vector<staged_state> staged;
    std::optional<result<load_info>> failed;
    m.for_each_part([&](const auto& part) {
        if (failed) return;
        const std::string who = std::string(fn) + ": part " + std::to_string(staged.size());
        auto st = parse_state(who.c_str(), part, parts.value()[staged.size()], kind, dst, opt);
        if (!st) {
            failed.emplace(make_error(st.code(), st.message()));
            return;
        }
        staged.push_back(std::move(st.value()));
    });
    if (failed) return std::move(*failed);
    // Strong guarantee also under std::bad_alloc: every part's metadata first, under a
    // checkpoint of the whole memory, then the K/V bytes (which cannot throw).
    auto commit_all = [&]() -> result<load_info> {
        std::vector<prepared_commit> prepared;
        m.for_each_part(internal_access{}, [&](auto& part) {
            if (failed) return;
            const std::string who = std::string(fn) + ": part " + std::to_string(prepared.size());
            auto pc = prepare_commit(who.c_str(), part, staged[prepared.size()], dst);
            if (!pc) {
                failed.emplace(make_error(pc.code(), pc.message()));
                return;
            }
            prepared.push_back(std::move(pc.value()));
        });
        if (failed) {  // put back the parts whose cells were chosen
            std::size_t i = 0;
            m.for_each_part(internal_access{}, [&](auto& part) {
                if (i < prepared.size()) rollback_commit(part, staged[i], prepared[i]);
                ++i;
            });
            return std::move(*failed);
        }
        std::vector<load_info> infos;
        infos.reserve(prepared.size());
        std::size_t i = 0;
        m.for_each_part(internal_access{}, [&](auto& part) {
            infos.push_back(finish_commit_meta(part, staged[i], dst, std::move(prepared[i])));
            ++i;
        });
        // Every part's copy plan before any part's bytes: a plan allocates, and a throw
        // after part 0's bytes were written would leave them under part 0's old cells.
        std::vector<copy_plan> plans;
        plans.reserve(infos.size());
        for (const load_info& in : infos) plans.push_back(make_copy_plan(in.cells));
        i = 0;
        m.for_each_part(internal_access{}, [&](auto& part) {
            write_state_kv(part, staged[i], infos[i], plans[i]);
            ++i;
        });
        return std::move(infos.front());
    };
    if constexpr (requires { typename M::checkpoint; })
        return kvcache::detail::with_rollback(m, commit_all);
    else
        return commit_all();
}

template <class M>
void check_composite_args(const char* fn, const M& m, bool one_seq, seq_id_t seq, std::span<const token_t> tokens,
                          std::span<const media_chunk> media) {
    m.for_each_part([&](const auto& part) { check_save_args(fn, part, one_seq, seq, tokens, media); });
}

}  // namespace detail

// ---------------------------------------------------------------------- saving

/// Bytes save_state() produces for this memory and prompt.
template <class Memory>
[[nodiscard]] std::size_t state_size(const Memory& mem, std::span<const token_t> tokens = {},
                                     std::span<const media_chunk> media = {}) {
    static_assert(memory<Memory>, "kvcache: io::state_size needs a kvcache::memory (see kvcache/memory/memory.hpp)");
    if constexpr (composite_memory<Memory>) {
        const auto sizes = detail::composite_part_sizes(mem, -1, tokens, media);
        return detail::composite_bytes(sizes);
    } else {
        const auto cells = detail::cells_to_save(mem, -1);
        return detail::state_bytes(mem, cells, -1, tokens.size(), media.size());
    }
}

/// Bytes save_seq() produces for sequence `seq` and this prompt.
template <class Memory>
[[nodiscard]] std::size_t seq_state_size(const Memory& mem, seq_id_t seq, std::span<const token_t> tokens = {},
                                         std::span<const media_chunk> media = {}) {
    static_assert(memory<Memory>, "kvcache: io::seq_state_size needs a kvcache::memory (see kvcache/memory/memory.hpp)");
    if constexpr (composite_memory<Memory>) {
        detail::check_composite_args("seq_state_size", mem, true, seq, tokens, media);
        return detail::composite_bytes(detail::composite_part_sizes(mem, seq, tokens, media));
    } else {
        detail::check_save_args("seq_state_size", mem, true, seq, tokens, media);
        const auto cells = detail::cells_to_save(mem, seq);
        return detail::state_bytes(mem, cells, seq, tokens.size(), media.size());
    }
}

/// Serialises the whole memory (every used cell: position, pending shift, sequences,
/// K/V of every layer; for a composite memory every part) plus an optional prompt
/// (tokens with media chunks) into `out`, which must hold exactly state_size() bytes.
/// Reusing one buffer avoids page faults.
template <class Memory>
void save_state_into(const Memory& mem, std::span<std::byte> out, std::span<const token_t> tokens = {},
                     std::span<const media_chunk> media = {}) {
    static_assert(memory<Memory>, "kvcache: io::save_state_into needs a kvcache::memory (see kvcache/memory/memory.hpp)");
    if constexpr (composite_memory<Memory>) {
        detail::check_composite_args("save_state", mem, false, -1, tokens, media);
        const auto sizes = detail::composite_part_sizes(mem, -1, tokens, media);
        const std::size_t need = detail::composite_bytes(sizes);
        if (out.size() != need)
            kvcache::detail::fail(errc::invalid_argument, "save_state_into: out has " + std::to_string(out.size()) +
                                                              " bytes, the state needs " + std::to_string(need));
        detail::write_composite(mem, -1, tokens, media, sizes, out);
    } else {
        detail::require_raw_view<Memory>();
        detail::check_save_args("save_state", mem, false, -1, tokens, media);
        const auto cells = detail::cells_to_save(mem, -1);
        const std::size_t need = detail::state_bytes(mem, cells, -1, tokens.size(), media.size());
        if (out.size() != need)
            kvcache::detail::fail(errc::invalid_argument, "save_state_into: out has " + std::to_string(out.size()) +
                                                              " bytes, the state needs " + std::to_string(need));
        detail::write_state(mem, cells, -1, tokens, media, out);
    }
}

/// Serialises the whole memory; see save_state_into.
template <class Memory>
[[nodiscard]] std::vector<std::byte> save_state(const Memory& mem, std::span<const token_t> tokens = {},
                                                std::span<const media_chunk> media = {}) {
    static_assert(memory<Memory>, "kvcache: io::save_state needs a kvcache::memory (see kvcache/memory/memory.hpp)");
    std::vector<std::byte> out(state_size(mem, tokens, media));
    save_state_into(mem, std::span<std::byte>(out), tokens, media);
    return out;
}

/// Serialises one sequence (its cells in cell order, each saved as used by `seq` only;
/// for a composite memory, in every part) plus an optional prompt into `out`, which must
/// hold exactly seq_state_size() bytes.
template <class Memory>
void save_seq_into(const Memory& mem, seq_id_t seq, std::span<std::byte> out, std::span<const token_t> tokens = {},
                   std::span<const media_chunk> media = {}) {
    static_assert(memory<Memory>, "kvcache: io::save_seq_into needs a kvcache::memory (see kvcache/memory/memory.hpp)");
    if constexpr (composite_memory<Memory>) {
        detail::check_composite_args("save_seq", mem, true, seq, tokens, media);
        const auto sizes = detail::composite_part_sizes(mem, seq, tokens, media);
        const std::size_t need = detail::composite_bytes(sizes);
        if (out.size() != need)
            kvcache::detail::fail(errc::invalid_argument, "save_seq_into: out has " + std::to_string(out.size()) +
                                                              " bytes, the state needs " + std::to_string(need));
        detail::write_composite(mem, seq, tokens, media, sizes, out);
    } else {
        detail::require_raw_view<Memory>();
        detail::check_save_args("save_seq", mem, true, seq, tokens, media);
        const auto cells = detail::cells_to_save(mem, seq);
        const std::size_t need = detail::state_bytes(mem, cells, seq, tokens.size(), media.size());
        if (out.size() != need)
            kvcache::detail::fail(errc::invalid_argument, "save_seq_into: out has " + std::to_string(out.size()) +
                                                              " bytes, the state needs " + std::to_string(need));
        detail::write_state(mem, cells, seq, tokens, media, out);
    }
}

/// Serialises one sequence; see save_seq_into.
template <class Memory>
[[nodiscard]] std::vector<std::byte> save_seq(const Memory& mem, seq_id_t seq, std::span<const token_t> tokens = {},
                                              std::span<const media_chunk> media = {}) {
    static_assert(memory<Memory>, "kvcache: io::save_seq needs a kvcache::memory (see kvcache/memory/memory.hpp)");
    std::vector<std::byte> out(seq_state_size(mem, seq, tokens, media));
    save_seq_into(mem, seq, std::span<std::byte>(out), tokens, media);
    return out;
}

// --------------------------------------------------------------------- loading

/// Replaces the whole memory by the state in `bytes` (saved by save_state from a cache
/// with the same model shape and element type, any layout; a composite memory's state
/// only into a composite of the same kind, window and parts). Cells are renumbered from
/// the layout's first free cell. On error the memory is unchanged and the result names
/// the problem: bad_magic, unsupported_version, truncated, trailing_bytes,
/// checksum_mismatch, shape_mismatch, dtype_mismatch, no_space, invalid_cell, unsupported.
/// Throws kvcache::error(transaction_open) if placements are staged.
template <class Memory>
[[nodiscard]] result<load_info> load_state(Memory& mem, std::span<const std::byte> bytes,
                                           const load_options& opt = {}) {
    static_assert(memory<Memory>, "kvcache: io::load_state needs a kvcache::memory (see kvcache/memory/memory.hpp)");
    if (mem.in_transaction())
        kvcache::detail::fail(errc::transaction_open, "load_state: placements are staged; commit() or restore() first");
    if constexpr (composite_memory<Memory>) {
        return detail::load_composite("load_state", mem, bytes, state_kind::whole_cache, -1, opt);
    } else {
        detail::require_raw_view<Memory>();
        auto st = detail::parse_state("load_state", mem, bytes, state_kind::whole_cache, -1, opt);
        if (!st) return detail::make_error(st.code(), st.message());
        return detail::commit_state("load_state", mem, std::move(st.value()), -1);
    }
}

/// Loads one sequence saved by save_seq into sequence `dst`, replacing what dst held;
/// other sequences are untouched. Errors as for load_state (the memory is unchanged).
/// Throws kvcache::error for dst outside [0, n_seq_max) or staged placements.
template <class Memory>
[[nodiscard]] result<load_info> load_seq(Memory& mem, seq_id_t dst, std::span<const std::byte> bytes,
                                         const load_options& opt = {}) {
    static_assert(memory<Memory>, "kvcache: io::load_seq needs a kvcache::memory (see kvcache/memory/memory.hpp)");
    if (mem.in_transaction())
        kvcache::detail::fail(errc::transaction_open, "load_seq: placements are staged; commit() or restore() first");
    if (dst < 0 || static_cast<std::uint32_t>(dst) >= mem.n_seq_max())
        kvcache::detail::fail(errc::invalid_argument, "load_seq: dst = " + std::to_string(dst) + ", must be in [0, " +
                                                          std::to_string(mem.n_seq_max()) + ")");
    if constexpr (composite_memory<Memory>) {
        return detail::load_composite("load_seq", mem, bytes, state_kind::one_sequence, dst, opt);
    } else {
        detail::require_raw_view<Memory>();
        auto st = detail::parse_state("load_seq", mem, bytes, state_kind::one_sequence, dst, opt);
        if (!st) return detail::make_error(st.code(), st.message());
        return detail::commit_state("load_seq", mem, std::move(st.value()), dst);
    }
}

}  // namespace io
KVCACHE_END_NAMESPACE

// Session files (save_file, load_file, ...) are part of this header's API.
#include "session.hpp"
