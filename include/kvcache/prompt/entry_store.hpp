// kvcache: how the global prompt cache keeps the K/V state of its entries (F21).
//
// An entry store saves the cells of one sequence and loads them back into a
// (possibly different) sequence. Three stores are provided:
//   - copy_store:   copies the cells' raw K/V elements out of the cache and back
//                   (llama-server's behaviour: the state survives anything the cache
//                   does later). The default.
//   - state_store:  (prompt/state_store.hpp) the same through io::save_seq /
//                   io::load_seq: the state format, validated and checksummed.
//   - shared_store: keeps the entry as an extra sequence of the same cache that
//                   shares the cells (seq_cp, no data copy). A hit shares the cells
//                   again; a later seq_add on the slot copies a shared cell first
//                   (copy-on-write, F5). A paged layout shares blocks the same way.
//
// Required members of a store S for a cache type C (checked by entry_store<S, C>):
//   1. typename S::handle;                                   movable saved state
//   2. result<handle> save(C&, seq_id_t seq);                 state of every cell of seq
//   3. result<void> load(C&, seq_id_t dst, const handle&);    dst must be empty; on error dst stays empty
//   4. std::size_t bytes(const C&, const handle&) const;      bytes the entry accounts for
//   5. void release(C&, handle&);                             frees what save() took
// Optional: bool valid(const C&, const handle&) const;  false once the cache changed the
// cells the entry relies on (shared_store); the prompt cache then drops the entry (metric
// `invalidated`) instead of serving it. Stores that copy the state out need none.
//
// Thread safety: a store is used by the prompt cache / slot manager that owns it, under
// that owner's rule (one thread at a time, together with the cache); no internal locking.
#pragma once

#include <algorithm>  // std::sort
#include <concepts>   // std::same_as
#include <cstddef>    // std::size_t
#include <cstdint>    // fixed-width integers
#include <cstring>    // std::memcpy
#include <span>       // placement positions
#include <string>     // messages
#include <type_traits>  // std::is_const_v
#include <utility>    // std::as_const
#include <variant>    // std::monostate
#include <vector>     // saved data

#include "../detail/policy_select.hpp"
#include "../error.hpp"
#include "../format/kv_view.hpp"
#include "../memory/memory.hpp"
#include "../model_shape.hpp"

KVCACHE_BEGIN_NAMESPACE

template <class S, class C>
concept entry_store = requires(S& s, const S& cs, C& c, const C& cc, seq_id_t seq, typename S::handle& h) {
    { s.save(c, seq) } -> std::same_as<result<typename S::handle>>;
    { s.load(c, seq, std::as_const(h)) } -> std::same_as<result<void>>;
    { cs.bytes(cc, std::as_const(h)) } -> std::convertible_to<std::size_t>;
    s.release(c, h);
};

/// Capability of a memory: `seq_generation(s)` changes with every change of the cells
/// sequence s holds (basic_kv_cache, iswa_cache). Slot states and prompt-cache entries
/// record it to detect a change under them; a memory without it is checked by the
/// extent of the sequence (seq_pos_min, seq_pos_max) only.
template <class M>
concept tracks_seq_generation = requires(const M& m, seq_id_t s) {
    { m.seq_generation(s) } -> std::convertible_to<std::uint64_t>;
};

namespace detail {
/// What a slot state or entry records about sequence s to detect a change under it.
template <class M>
std::uint64_t seq_fingerprint(const M& m, seq_id_t s) {
    if constexpr (tracks_seq_generation<M>)
        return static_cast<std::uint64_t>(m.seq_generation(s));
    else
        return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(m.seq_pos_min(s))) << 32) ^
               static_cast<std::uint32_t>(m.seq_pos_max(s));
}

/// Whether store S can tell that an entry went stale (the optional valid() member).
template <class S, class C>
concept checks_entries = requires(const S& s, const C& c, const typename S::handle& h) {
    { s.valid(c, h) } -> std::convertible_to<bool>;
};

/// Whether store S undoes its own changes to the cache (shared_store): save_undo records
/// the cache and the store (may throw, nothing changed), load_undo puts both back without
/// allocating. The prompt cache runs its operations under such a record (strong guarantee).
template <class S, class C>
concept undoable_store = requires(S& s, C& c, typename S::undo_record& u) {
    s.save_undo(c, u);
    { s.load_undo(c, u) } noexcept;
};
/// S::undo_record when Undoable, else an empty type.
template <class S, bool Undoable>
struct undo_record_or {
    using type = std::monostate;
};
template <class S>
struct undo_record_or<S, true> {
    using type = typename S::undo_record;
};
/// Cache::checkpoint (kv_cache, iswa_cache) when the memory has one, else an empty type.
template <class C>
struct checkpoint_or {
    using type = std::monostate;
};
template <class C>
    requires requires { typename C::checkpoint; }
struct checkpoint_or<C> {
    using type = typename C::checkpoint;
};

/// Cells of sequence s in increasing position order.
template <class Cache>
std::vector<std::uint32_t> seq_cells_by_pos(const Cache& cache, seq_id_t s) {
    std::vector<std::pair<pos_t, std::uint32_t>> v;
    const auto& cells = cache.cells();
    for (std::uint32_t c : cells.used_cells())
        if (cells.seqs(c).test(s)) v.emplace_back(cells.pos(c), c);
    std::sort(v.begin(), v.end());
    std::vector<std::uint32_t> out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = v[i].second;
    return out;
}
}  // namespace detail

/// Copies an entry's K/V out of the cache (raw storage elements, bit-exact) and back in,
/// layers in parallel (OpenMP) for large entries. Thread safety: stateless; save reads the
/// cache (safe beside other const calls), load changes it (exclusive access).
template <class Cache>
class copy_store {
    static_assert(kv_memory<Cache>, "kvcache: copy_store<Cache> needs a kvcache::kv_memory (one K/V cache; use "
                                    "state_store for a composite memory such as iswa_cache)");

public:
    using storage_type = typename Cache::storage_type;
    /// Handles are plain data: copying one copies the saved state.
    static constexpr bool copyable_handles = true;
    /// Saved cells: positions and pending K-shift deltas in save order i, then per layer the
    /// K/V elements in the cache's own arrangement restricted to those cells: K as
    /// [head][row][i], V as [head][i][d] (row-major V) or [head][d][i] (transposed V), so runs
    /// of consecutive cells move with memcpy (block elements: storage units in place of
    /// rows and dimensions, format/kv_view.hpp "Block elements").
    struct handle {
        std::vector<pos_t> pos;
        std::vector<std::int32_t> shift;
        std::vector<storage_type> data;
        std::vector<mrope_pos> ext;  ///< M-RoPE extra positions per cell (M-RoPE caches only)
    };

    /// Copies every cell of seq.
    result<handle> save(Cache& cache, seq_id_t seq) {
        const auto cells = detail::seq_cells_by_pos(cache, seq);
        const model_shape& sh = cache.shape();
        const std::size_t row = units_per_row(sh);
        handle h;
        h.pos.reserve(cells.size());
        h.shift.reserve(cells.size());
        for (std::uint32_t c : cells) {
            h.pos.push_back(cache.cells().pos(c));
            h.shift.push_back(cache.cells().shift(c));
            if (cache.cells().has_ext()) h.ext.push_back(cache.cells().ext(c));
        }
        h.data.resize(row * cells.size() * sh.n_layer);
        const std::size_t per_layer = row * cells.size();
        storage_type* out = h.data.data();
        const auto n_layer = static_cast<std::int64_t>(sh.n_layer);
        KVCACHE_OMP(parallel for schedule(static) if (per_layer * sh.n_layer > parallel_min))
        for (std::int64_t l = 0; l < n_layer; ++l)
            transfer<true>(cache.storage().view(static_cast<std::uint32_t>(l)), cells,
                           out + static_cast<std::size_t>(l) * per_layer);
        return h;
    }

    /// Places the saved cells into the empty sequence dst and writes their K/V back. A
    /// sequence holding a position in several cells (normal after seq_div) is restored as
    /// saved. Strong under std::bad_alloc: the K/V bytes are written after the last step
    /// that can throw (the cache is bit-identical after a throw, free cells included). Throws transaction_open while the host has placements staged (loading commits
    /// its own placement, and must not commit the host's); error results, nothing changed:
    /// dst not empty (invalid_argument), malformed handle (shape_mismatch), no room (no_space).
    result<void> load(Cache& cache, seq_id_t dst, const handle& h) {
        if (cache.in_transaction())
            detail::fail(errc::transaction_open,
                         "copy_store::load: placements are staged; commit() or restore() them first");
        if (cache.seq_pos_max(dst) >= 0)
            return detail::make_error(errc::invalid_argument,
                                      "copy_store::load: destination sequence " + std::to_string(dst) + " is not empty");
        const model_shape& sh = cache.shape();
        const std::size_t row = units_per_row(sh);
        if (h.data.size() != row * h.pos.size() * sh.n_layer || h.shift.size() != h.pos.size() ||
            h.ext.size() != (sh.rope.mrope.on() ? h.pos.size() : 0))
            return detail::make_error(errc::shape_mismatch, "copy_store::load: entry holds " +
                                                                std::to_string(h.data.size()) + " elements for " +
                                                                std::to_string(h.pos.size()) + " cells, expected " +
                                                                std::to_string(row * h.pos.size() * sh.n_layer));
        if (h.pos.empty()) return {};
        std::vector<seq_id_t> seqs(h.pos.size(), dst);
        // A position held twice cannot be placed as is (a batch holds each position of a
        // sequence once): place at distinct stand-in positions, then set the saved ones.
        // Only layouts that move positions (can_shift) produce such sequences.
        const bool repeated = std::adjacent_find(h.pos.begin(), h.pos.end()) != h.pos.end();  // save order is by position
        std::vector<pos_t> stand_in;
        if (repeated) {
            if constexpr (!Cache::can_shift)
                return detail::make_error(errc::unsupported,
                                          "copy_store::load: the entry holds a position twice, which a layout "
                                          "without can_shift cannot hold");
            stand_in.resize(h.pos.size());
            for (std::size_t i = 0; i < stand_in.size(); ++i) stand_in[i] = static_cast<pos_t>(i);
        }
        // A checkpoint for the position moves below (they allocate): taken before placing.
        [[maybe_unused]] typename Cache::checkpoint cp;
        if (repeated) cache.save_checkpoint(cp, detail::internal_access{});
        auto placed = cache.place(repeated ? std::span<const pos_t>(stand_in) : std::span<const pos_t>(h.pos),
                                  std::span<const seq_id_t>(seqs), std::span<const mrope_pos>(h.ext));
        if (!placed) return detail::make_error(placed.code(), "copy_store::load: " + placed.message());
        const auto& cells = placed.value().cells;
        // Metadata first, K/V last: every step that can throw (a commit hook, the position
        // moves) runs before the first byte is written, and a throw puts the cells back.
        try {
            static_cast<void>(cache.commit());
        } catch (...) {
            cache.restore();  // a commit hook threw: the placement is still staged
            throw;
        }
        auto& table = cache.cells_for_update(detail::internal_access{});
        try {
            if (repeated)
                for (std::size_t i = 0; i < cells.size(); ++i) table.move_pos(cells[i], h.pos[i]);
            table.reserve_journal(cells.size());  // under a live checkpoint: the set_shift run below cannot throw
        } catch (...) {
            if (repeated) cache.load_checkpoint(cp, detail::internal_access{});
            throw;
        }
        for (std::size_t i = 0; i < cells.size(); ++i) table.set_shift(cells[i], h.shift[i]);
        const std::size_t per_layer = row * cells.size();
        const storage_type* in = h.data.data();
        const auto n_layer = static_cast<std::int64_t>(sh.n_layer);
        KVCACHE_OMP(parallel for schedule(static) if (per_layer * sh.n_layer > parallel_min))
        for (std::int64_t l = 0; l < n_layer; ++l)
            transfer<false>(cache.storage().view(static_cast<std::uint32_t>(l)), cells,
                            in + static_cast<std::size_t>(l) * per_layer);
        return {};
    }

private:
    /// Storage units of one cell's K and V row in one layer (values / block size).
    static std::size_t units_per_row(const model_shape& sh) noexcept {
        return (sh.k_row_size() + sh.v_row_size()) / element_block_size_v<typename Cache::element>;
    }
    /// Elements below which save/load stay on one thread (OpenMP start-up costs more).
    static constexpr std::size_t parallel_min = std::size_t{1} << 18;

    /// Copies one layer between the cache (cells, in save order) and buf (Save: cache -> buf).
    /// Runs of consecutive cells are copied as contiguous segments (K: up to one K tile).
    template <bool Save, class View, class Buf>
    static void transfer(const View& v, const std::vector<std::uint32_t>& cells, Buf* buf) {
        static_assert(std::is_same_v<std::remove_const_t<Buf>, storage_type> && Save == !std::is_const_v<Buf>);
        const std::size_t n = cells.size();
        auto copy = [](storage_type* cache_ptr, Buf* buf_ptr, std::size_t count) {
            if constexpr (Save)
                std::memcpy(buf_ptr, cache_ptr, count * sizeof(storage_type));
            else
                std::memcpy(cache_ptr, buf_ptr, count * sizeof(storage_type));
        };
        Buf* kbuf = buf;
        const std::uint32_t ku = v.k_units(), vu = v.v_units(), lg = v.block_log2;  // (block elements: units)
        Buf* vbuf = buf + n * v.n_head_kv * ku;
        for (std::size_t i0 = 0; i0 < n;) {
            std::size_t len = 1;  // run of consecutive cells starting at save index i0
            while (i0 + len < n && cells[i0 + len] == cells[i0] + len) ++len;
            for (std::uint32_t h = 0; h < v.n_head_kv; ++h) {
                // Pieces that stay inside one tile: K [h][d][n]; row-major V [h][block][n][width]
                // (the cache's V blocks, so each block of a piece is one copy).
                for (std::size_t done = 0; done < len;) {
                    const auto c = static_cast<std::uint32_t>(cells[i0] + done);
                    const std::size_t seg = std::min<std::size_t>(len - done, k_tile - c % k_tile);
                    for (std::uint32_t u = 0; u < ku; ++u)
                        copy(v.k + v.k_unit(h, c, u), kbuf + (std::size_t{h} * ku + u) * n + i0 + done, seg);
                    if (v.vl == v_layout::row_major)
                        for (std::uint32_t d0 = 0; d0 < v.dim_v; d0 += v_block) {
                            const std::size_t w = std::min(v_block, v.dim_v - d0) >> lg;
                            copy(v.v + v.v_offset(h, c, d0),
                                 vbuf + std::size_t{h} * n * vu + std::size_t{d0 >> lg} * n + (i0 + done) * w, seg * w);
                        }
                    done += seg;
                }
                if (v.vl != v_layout::row_major)
                    for (std::uint32_t u = 0; u < vu; ++u)
                        copy(v.v + v.v_unit(h, cells[i0], u), vbuf + (std::size_t{h} * vu + u) * n + i0, len);
            }
            i0 += len;
        }
    }

public:
    /// Bytes of the copied K/V plus per-cell metadata.
    [[nodiscard]] std::size_t bytes(const Cache&, const handle& h) const noexcept {
        return h.data.size() * sizeof(storage_type) + h.pos.size() * (sizeof(pos_t) + sizeof(std::int32_t));
    }
    void release(Cache&, handle& h) noexcept {
        h = handle{};
    }
};

/// Keeps entries as extra sequences of the same cache that share the cells (no copy).
/// Sequence ids [first_seq, first_seq + n_seq) are reserved for entries; the host must not use them.
/// Thread safety: not thread-safe (save, load and release change the cache and the free list).
template <class Cache>
class shared_store {
    static_assert(memory<Cache>, "kvcache: shared_store<Cache> needs a kvcache::memory (see kvcache/memory/memory.hpp)");

public:
    /// The entry's sequence id and the generation (detail::seq_fingerprint) it had when saved.
    struct handle {
        seq_id_t seq = -1;
        std::uint64_t generation = 0;
    };

    shared_store(seq_id_t first_seq, std::uint32_t n_seq) : first_(first_seq), n_(n_seq) {
        if (first_seq < 0) detail::fail(errc::invalid_argument, "shared_store: first_seq = " + std::to_string(first_seq) + ", must be >= 0");
        free_.reserve(n_seq);  // release() pushes back within this room
        for (std::uint32_t i = n_seq; i > 0; --i) free_.push_back(first_seq + static_cast<seq_id_t>(i - 1));
    }

    /// Shares every cell of seq with a reserved sequence (seq_cp). Error no_space when every
    /// reserved sequence id holds an entry, or seq_cp's error when the layout refuses the copy.
    result<handle> save(Cache& cache, seq_id_t seq) {
        if (free_.empty())
            return detail::make_error(errc::no_space, "shared_store::save: every reserved sequence id holds an entry");
        const seq_id_t e = free_.back();
        if (static_cast<std::uint32_t>(e) >= cache.shape().n_seq_max)
            detail::fail(errc::invalid_argument, "shared_store: reserved sequence " + std::to_string(e) +
                                                     " is not below n_seq_max = " + std::to_string(cache.shape().n_seq_max));
        cache.seq_rm(e, -1, -1).value();  // the whole sequence: never refused
        if (result<void> r = cache.seq_cp(seq, e, -1, -1); !r)  // a layout may refuse (ring: pruned positions)
            return detail::make_error(r.code(), "shared_store::save: " + r.message());
        free_.pop_back();
        return handle{e, detail::seq_fingerprint(cache, e)};
    }
    /// Whether the entry's sequence still holds exactly the cells it held when saved (the
    /// host's seq_rm(-1, ...), seq_keep, clear, seq_add(-1, ...) ... change them).
    [[nodiscard]] bool valid(const Cache& cache, const handle& h) const {
        return h.seq >= 0 && detail::seq_fingerprint(cache, h.seq) == h.generation;
    }
    /// Shares the entry's cells with the empty sequence dst. Error results, nothing changed:
    /// dst not empty (invalid_argument), the entry's cells changed under it (invalid_cell),
    /// seq_cp's refusal.
    result<void> load(Cache& cache, seq_id_t dst, const handle& h) {
        if (!valid(cache, h))
            return detail::make_error(errc::invalid_cell, "shared_store::load: the entry's cells (sequence " +
                                                              std::to_string(h.seq) +
                                                              ") changed since it was saved; entry invalidated");
        if (cache.seq_pos_max(dst) >= 0)
            return detail::make_error(errc::invalid_argument,
                                      "shared_store::load: destination sequence " + std::to_string(dst) + " is not empty");
        if (result<void> r = cache.seq_cp(h.seq, dst, -1, -1); !r)
            return detail::make_error(r.code(), "shared_store::load: " + r.message());
        return {};
    }
    /// Bytes of the cells the entry keeps alive (shared cells counted in full).
    [[nodiscard]] std::size_t bytes(const Cache& cache, const handle& h) const {
        return std::size_t{cache.cells().seq_cell_count(h.seq)} * cache.bytes_per_token();
    }
    void release(Cache& cache, handle& h) {
        if (h.seq < 0) return;
        cache.seq_rm(h.seq, -1, -1).value();  // the whole sequence: never refused
        free_.push_back(h.seq);
        h.seq = -1;
    }
    /// What undoes the store's changes to the cache and to itself (the prompt cache's
    /// strong guarantee, detail::undoable_store): a checkpoint of the cache (cell table and
    /// the layout's tables: save and release share and unshare cells, no K/V byte is
    /// written) and a copy of the free list. Taking one journals the cell table's changes from
    /// then on (cell_table::mark) and copies the layout's tables, if any.
    struct undo_record {
        typename detail::checkpoint_or<Cache>::type cache{};
        std::vector<seq_id_t> free;
    };
    /// Records the cache and the store (may throw std::bad_alloc; nothing changed then).
    void save_undo(Cache& cache, undo_record& u) const
        requires requires { typename Cache::checkpoint; }
    {
        cache.save_checkpoint(u.cache, detail::internal_access{});
        u.free = free_;
    }
    /// Puts the cache and the store back as recorded (swaps: never allocates).
    void load_undo(Cache& cache, undo_record& u) noexcept
        requires requires { typename Cache::checkpoint; }
    {
        cache.load_checkpoint(u.cache, detail::internal_access{});
        free_.swap(u.free);
    }

    /// Reserved sequence ids not holding an entry.
    [[nodiscard]] std::size_t n_free() const noexcept { return free_.size(); }
    /// Reserved sequence ids not holding an entry, the next one save() takes last.
    [[nodiscard]] std::span<const seq_id_t> free_ids() const noexcept { return free_; }
    /// Whether sequence id s is reserved for entries.
    [[nodiscard]] bool reserves(seq_id_t s) const noexcept { return s >= first_ && std::int64_t{s} < std::int64_t{first_} + n_; }

private:
    seq_id_t first_;
    std::uint32_t n_;
    std::vector<seq_id_t> free_;  // reserved ids without an entry
};

KVCACHE_END_NAMESPACE
