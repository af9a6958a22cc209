// kvcache: kv_cache<Policies...>, the cache type a host program instantiates.
//
// Thread-safety contract
// ----------------------
// - A kv_cache is a single-writer object. Calls that change it (place, write_k,
//   write_v, commit, restore, seq_*, clear, and the K-shift in ops/) need external
//   locking if several threads use the same cache.
// - Const calls (queries, read_k/read_v, attention in ops/) may run concurrently
//   with each other, but not with a writer.
// - Kernels may use OpenMP threads inside one call; that is invisible to callers.
// - Different kv_cache objects share nothing and can be used from different
//   threads freely.
//
// Exception safety (strong guarantee)
// -----------------------------------
// Every mutating operation (place, commit, restore, seq_rm / seq_cp / seq_keep /
// seq_add / seq_div, clear, and the compound operations of ops/, reuse/ and io/ built on
// them) either completes or leaves the cache bit-identical: cell metadata, indexes, the
// layout's tables (block tables, refcounts, free blocks, placement hints, ring pruning
// points), the slot-search head and the K/V bytes of occupied cells. That holds for error
// results and for exceptions, std::bad_alloc included. Each operation first saves a
// checkpoint (a rollback point of the cell table, whose changes are then journaled as
// their inverses: cell_table::mark, O(changes), not O(cells); plus a copy of the layout's
// tables where the layout keeps any, reusing the memory of the previous one) and puts it
// back without allocating; K/V bytes are copied only after the last step that can throw,
// and only into free cells. restore() returns to the checkpoint
// of the first staged placement and never throws. Free cells' K/V bytes are not state.
// ops::apply_k_shift is refused (transaction_open) while placements are staged.
#pragma once

#include <algorithm>  // std::min, std::max
#include <cstddef>    // std::size_t
#include <cstdint>    // fixed-width integers
#include <limits>     // position limits
#include <memory>     // observer checkpoints
#include <span>       // batch inputs
#include <string>     // messages
#include <type_traits>  // std::is_same_v
#include <utility>    // std::pair
#include <vector>     // placements, staging

#include "../cells/cell_table.hpp"
#include "../cells/rollback.hpp"
#include "../concepts.hpp"
#include "../detail/policy_select.hpp"
#include "../element/contract.hpp"
#include "../element/f32.hpp"
#include "../error.hpp"
#include "../layout/capabilities.hpp"
#include "../layout/contiguous.hpp"
#include "../model_shape.hpp"
#include "../reuse/none.hpp"
#include "memory.hpp"

KVCACHE_BEGIN_NAMESPACE

template <class Element, class Layout, class Reuse>
class basic_kv_cache;

namespace detail {
/// Turns kv_cache<Policies...> into its one canonical type: checks the policy list (each
/// a known kind, each kind at most once) and fills in the default of every kind left out.
template <class... Policies>
struct compose_cache {
    static_assert((detail::is_known_policy<Policies>() && ...),
                  "kvcache: every policy must declare `using policy_kind = kvcache::element_tag;` "
                  "(or layout_tag / reuse_tag); see kvcache/concepts.hpp");
    static_assert(detail::count_kind<element_tag, Policies...>() <= 1,
                  "kvcache: more than one element policy given to kv_cache");
    static_assert(detail::count_kind<layout_tag, Policies...>() <= 1,
                  "kvcache: more than one layout policy given to kv_cache");
    static_assert(detail::count_kind<reuse_tag, Policies...>() <= 1,
                  "kvcache: more than one reuse policy given to kv_cache");
    using type = basic_kv_cache<detail::select_policy_t<element_tag, f32, Policies...>,
                                detail::select_policy_t<layout_tag, contiguous<>, Policies...>,
                                detail::select_policy_t<reuse_tag, reuse::none, Policies...>>;
};
}  // namespace detail

/// The KV cache a host program instantiates, from policies in any order, each kind at
/// most once, with a default for each kind left out:
///   - element: f32 (default), f16, bf16, or a type satisfying element_policy
///   - layout:  contiguous<> (default) or a type satisfying layout_policy
///   - reuse:   reuse::none (default) or a type satisfying reuse_policy
/// Every spelling of the same policies names one type, basic_kv_cache<Element, Layout,
/// Reuse>: kv_cache<f16, contiguous<>>, kv_cache<contiguous<>, f16> and
/// kv_cache<f16, contiguous<>, reuse::none> are the same type, and so are kv_cache<> and
/// kv_cache<f32>. See concepts.hpp for what a custom policy must provide.
template <class... Policies>
using kv_cache = typename detail::compose_cache<Policies...>::type;

/// The KV cache with its policies in canonical order (use kv_cache<Policies...> to name
/// it): cell metadata (cells/) + K/V storage (layout policy) + policies.
/// Thread safety: like a standard container. Concurrent const calls (queries, attention,
/// io::save_*) are safe; a mutating call (place, commit, restore, write_k/v, sequence
/// operations, K-shift, defrag, loads) needs exclusive access. Distinct caches are independent.
template <class Element, class Layout, class Reuse>
class basic_kv_cache {
public:
    using memory_concept = memory_tag;  // opts in to kvcache::memory (memory.hpp)
    using element = Element;
    using layout = Layout;
    using reuse = Reuse;
    using placement_type = placement;
    /// Whether positions may move (seq_add / seq_div): the layout's can_shift.
    static constexpr bool can_shift = Layout::can_shift;

    static_assert(detail::check_element<element>(),  // (one static_assert per member inside)
                  "kvcache: the element policy does not satisfy kvcache::element_policy (see kvcache/concepts.hpp)");
    static_assert(detail::check_tiled_element<element>(),
                  "kvcache: the tiled layouts store elements of block_size 1 or 32 only");
    static_assert(layout_policy<layout>,
                  "kvcache: the layout policy does not satisfy kvcache::layout_policy (see kvcache/concepts.hpp)");
    static_assert(requires { typename layout::template storage<element>; },
                  "kvcache: the layout policy has no `template <class Element> class storage` (derive it from "
                  "kvcache::tiled_kv_storage, see kvcache/layout/kv_storage.hpp)");
    static_assert(std::constructible_from<typename layout::template storage<element>, const model_shape&>,
                  "kvcache: the layout's storage<Element> is not constructible from `const model_shape&`");
    static_assert(storage_has_storage_type<typename layout::template storage<element>> &&
                      std::same_as<typename layout::template storage<element>::storage_type,
                                   typename element::storage_type>,
                  "kvcache: the layout's storage<Element> must define `using storage_type = "
                  "Element::storage_type;` (tiled_kv_storage does)");
    static_assert(storage_has_view<typename layout::template storage<element>>,
                  "kvcache: the layout's storage<Element> has no view(layer) returning kv_layer_view<storage_type> "
                  "(and kv_layer_view<const storage_type> when const), which attention, the K-shift and state "
                  "files read; derive it from kvcache::tiled_kv_storage (kvcache/layout/kv_storage.hpp)");
    static_assert(storage_has_n_cells_padded<typename layout::template storage<element>>,
                  "kvcache: the layout's storage<Element> has no `std::uint32_t n_cells_padded() const`; derive "
                  "it from kvcache::tiled_kv_storage (kvcache/layout/kv_storage.hpp)");
    static_assert(layout_policy_for<layout, element>,
                  "kvcache: the layout policy's storage<Element> does not satisfy kvcache::kv_storage "
                  "(see kvcache/concepts.hpp)");
    static_assert(reuse_policy<reuse>,
                  "kvcache: the reuse policy does not satisfy kvcache::reuse_policy (see kvcache/concepts.hpp)");
    static_assert(!(reuse_policy<reuse> && layout_policy<layout>) || reuse_fits_layout<reuse, layout>,
                  "kvcache: the reuse policy's plans move cells (needs_shift = true) but the layout cannot move "
                  "positions (can_shift = false); use a reuse policy with needs_shift = false (reuse::lcp)");

    using storage_type = typename element::storage_type;
    using storage_t = typename layout::template storage<element>;
    static_assert(detail::check_layout_capabilities<storage_t>());

    /// Builds a cache for `shape`; throws kvcache::error(invalid_config) naming a bad parameter.
    /// Allocates every buffer once, zero-initialised (F2).
    explicit basic_kv_cache(const model_shape& shape)
        : shape_(validated(shape)), cells_(shape.n_cells, shape.n_seq_max, shape.rope.mrope.on()), storage_(shape) {
        // Layout capability: storage with block/region bookkeeping follows every cell change.
        if constexpr (has_capability<storage_t, layout_caps::cell_observer>) cells_.set_observer(storage_.observer());
    }

    basic_kv_cache(const basic_kv_cache&) = delete;
    basic_kv_cache& operator=(const basic_kv_cache&) = delete;
    basic_kv_cache(basic_kv_cache&&) noexcept = default;
    basic_kv_cache& operator=(basic_kv_cache&&) noexcept = default;

    // ------------------------------------------------------------------ queries

    [[nodiscard]] const model_shape& shape() const noexcept { return shape_; }
    /// Sequences the cache tracks: ids [0, n_seq_max).
    [[nodiscard]] std::uint32_t n_seq_max() const noexcept { return shape_.n_seq_max; }
    /// Layers with K/V.
    [[nodiscard]] std::uint32_t n_layer() const noexcept { return shape_.n_layer; }
    /// Capacity in cells.
    [[nodiscard]] std::uint32_t capacity() const noexcept { return cells_.size(); }
    /// Occupied cells.
    [[nodiscard]] std::uint32_t used() const noexcept { return cells_.used(); }
    /// Bytes one token occupies in all layers (K and V).
    [[nodiscard]] std::size_t bytes_per_token() const noexcept {
        return values_bytes<element>(shape_.bytes_per_token(1));  // (1: the value count)
    }
    /// Bytes of every K/V buffer (including tile padding).
    [[nodiscard]] std::size_t total_bytes() const noexcept { return storage_.bytes(); }
    /// Cell metadata (positions, sequences, pending shifts).
    [[nodiscard]] const cell_table& cells() const noexcept { return cells_; }
    /// K/V storage, for kernels (ops/) and state I/O.
    [[nodiscard]] const storage_t& storage() const noexcept { return storage_; }
    [[nodiscard]] storage_t& storage() noexcept { return storage_; }

    /// Attention window (F8): cells [0, n) hold every used cell; n is padded to a
    /// multiple of `pad` (32 by default, 256 for flash-style kernels) and capped at capacity.
    [[nodiscard]] std::uint32_t n_window(std::uint32_t pad = 32) const {
        if (pad == 0) detail::fail(errc::invalid_argument, "n_window: pad = 0, must be >= 1");
        if (cells_.used() == 0) return 0;
        const std::uint64_t n = std::uint64_t{cells_.last_used()} + 1;
        const std::uint64_t padded = (n + pad - 1) / pad * pad;
        return static_cast<std::uint32_t>(std::min<std::uint64_t>(padded, capacity()));
    }

    [[nodiscard]] pos_t seq_pos_min(seq_id_t s) const {
        check_seq("seq_pos_min", "seq_id", s, false);
        return cells_.seq_pos_min(s);
    }
    [[nodiscard]] pos_t seq_pos_max(seq_id_t s) const {
        check_seq("seq_pos_max", "seq_id", s, false);
        return cells_.seq_pos_max(s);
    }
    /// Generation of sequence s: changes (to a value never returned before in the process)
    /// with every change of the cells s holds (placement, restore, every sequence operation,
    /// clear, state loads, defragmentation moves); equal values mean s holds the same cells
    /// at the same positions. Not changed by K/V writes or applying a K-shift.
    [[nodiscard]] std::uint64_t seq_generation(seq_id_t s) const {
        check_seq("seq_generation", "seq_id", s, false);
        return cells_.seq_generation(s);
    }

    /// Reads one cell's K (or V) row of a layer back as floats: n_head_kv x head_dim values.
    void read_k(std::uint32_t layer, std::uint32_t cell, float* row) const {
        check_layer_cell("read_k", layer, cell);
        storage_.read_k(layer, cell, row);
    }
    void read_v(std::uint32_t layer, std::uint32_t cell, float* row) const {
        check_layer_cell("read_v", layer, cell);
        storage_.read_v(layer, cell, row);
    }

    // -------------------------------------------------------- placement (F3, F4)

    /// Places a micro-batch: token i has position pos[i] and belongs to sequence seq[i].
    /// Batch position rule: a sequence that holds cells continues after its last position,
    /// its positions increasing in batch order (gaps are allowed: the host owns its
    /// positions); a sequence with no cells takes any distinct positions >= 0 (a new
    /// prompt, or a saved sequence put back in cell order). A decreasing or repeated
    /// position, or one at or below the sequence's last, throws invalid_argument naming
    /// the sequence and positions. Placement has the strong guarantee: a refusal or a throw (also
    /// std::bad_alloc) leaves the cache bit-identical.
    /// Invalid arguments throw kvcache::error(invalid_argument) and change nothing.
    /// Not enough free cells: an error result (no_space / batch_too_large), nothing changed.
    /// Placed cells are staged until commit() / restore().
    /// A cache whose shape has M-RoPE sections (rope.mrope) needs each token's extra
    /// positions: use the overloads taking `ext`; these throw invalid_argument there.
    [[nodiscard]] result<placement> place(std::span<const pos_t> pos, std::span<const seq_id_t> seq) {
        return place(pos, seq, std::span<const mrope_pos>{});
    }

    /// M-RoPE placement: as above, token i with extra positions ext[i] (h, w, e; each >= 0),
    /// kept by its cell through every sequence operation, defragmentation and state file.
    /// ext must have one entry per token for an M-RoPE cache and be empty otherwise
    /// (invalid_argument naming the problem, nothing changed).
    [[nodiscard]] result<placement> place(std::span<const pos_t> pos, std::span<const seq_id_t> seq,
                                          std::span<const mrope_pos> ext) {
        if (pos.size() != seq.size())
            detail::fail(errc::invalid_argument, "place: pos has " + std::to_string(pos.size()) +
                                                     " entries but seq has " + std::to_string(seq.size()));
        std::vector<seq_set> sets(seq.size());
        for (std::size_t i = 0; i < seq.size(); ++i) {
            check_seq("place", "seq[" + std::to_string(i) + "]", seq[i], false);
            sets[i] = seq_set::of(seq[i]);
        }
        return place(pos, std::span<const seq_set>(sets), ext);
    }

    /// Places a micro-batch whose tokens may belong to several sequences each (seqs[i] non-empty).
    [[nodiscard]] result<placement> place(std::span<const pos_t> pos, std::span<const seq_set> seqs) {
        return place(pos, seqs, std::span<const mrope_pos>{});
    }

    /// Multi-sequence M-RoPE placement (see the ext overload above).
    [[nodiscard]] result<placement> place(std::span<const pos_t> pos, std::span<const seq_set> seqs,
                                          std::span<const mrope_pos> ext) {
        check_no_foreign_seqs(seqs);
        validate_batch(pos, seqs);
        check_ext(pos.size(), ext);
        const auto n = static_cast<std::uint32_t>(pos.size());
        if (pos.size() > capacity())
            return detail::make_error(errc::batch_too_large, "place: batch of " + std::to_string(pos.size()) +
                                                                 " tokens exceeds capacity " +
                                                                 std::to_string(capacity()));
        if (n > cells_.free_count())
            return detail::make_error(errc::no_space, "place: batch of " + std::to_string(n) + " tokens needs " +
                                                          std::to_string(n) + " free cells, " +
                                                          std::to_string(cells_.free_count()) + " free");
        // Strong guarantee: everything (the layout's planning hints included) goes back to
        // this checkpoint on a refusal or a throw. The first placement of a transaction
        // checkpoints into tx_cp_, which restore() returns to.
        const bool first = staged_.empty();
        checkpoint& cp = first ? tx_cp_ : op_cp_;
        save_checkpoint(cp);
        if (first) tx_emptied_.clear();
        const std::size_t staged_before = staged_.size();
        const std::size_t backups_before = tx_backup_.size();
        const std::size_t emptied_before = tx_emptied_.size();
        const std::uint32_t head_in = head_;
        // The op's rollback point ends with it; a transaction's stays until commit / restore.
        auto undo = [&]() noexcept {
            load_checkpoint(cp);
            staged_.resize(staged_before);
            tx_backup_.resize(backups_before);
            tx_emptied_.resize(emptied_before);
            cells_.release(cp.cells);
        };
        try {
            placement out;
            std::vector<cell_copy> copies;
            if constexpr (has_capability<storage_t, layout_caps::placement_plan>) {
                // Layout capability: the layout picks the cells and any copy-on-write of shared cells.
                auto plan = storage_.plan_place(cells_, pos, seqs);
                if (!plan) {
                    auto err = detail::make_error(plan.code(), plan.message());  // may throw: undone once, below
                    undo();
                    return err;
                }
                out.cells = std::move(plan.value().cells);
                copies = std::move(plan.value().copies);
            } else {
                out.cells = find_free_cells(n);
                if (first) cp.head = head_;  // restore() keeps the search restart (F3), as before
            }
            // A cell an earlier copy-on-write of this transaction emptied is free now but held
            // K/V when the transaction began: keep its bytes, so restore() can put them back.
            if (!first) {
                for (const std::uint32_t c : out.cells) backup_if_held_at_tx_start(c);
                for (const cell_copy& c : copies) backup_if_held_at_tx_start(c.dst);
            }
            guard_cells(out.cells);
            for (const cell_copy& c : copies) guard_cell(c.dst);
            staged_.reserve(staged_.size() + n + copies.size());
            if (!copies.empty()) tx_emptied_.reserve(tx_emptied_.size() + copies.size());
            for (const cell_copy& c : copies) {  // c.seq moves from c.src to its own copy c.dst
                staged_.push_back(c.dst);
                cells_.occupy(c.dst, cells_.pos(c.src), seq_set::of(c.seq), cells_.ext(c.src));
                cells_.set_shift(c.dst, cells_.shift(c.src));
                cells_.rm_seq(c.src, c.seq);
                // Emptied: if it held K/V when the transaction began, a later placement of this
                // transaction that takes it keeps those bytes for restore().
                if (cells_.is_free(c.src) &&
                    std::find(staged_.begin(), staged_.begin() + static_cast<std::ptrdiff_t>(staged_before), c.src) ==
                        staged_.begin() + static_cast<std::ptrdiff_t>(staged_before))
                    tx_emptied_.push_back(c.src);
            }
            for (std::uint32_t i = 0; i < n; ++i) {
                staged_.push_back(out.cells[i]);
                cells_.occupy(out.cells[i], pos[i], seqs[i], ext.empty() ? mrope_pos{} : ext[i]);
            }
            // K/V last (never throws): a throw above leaves every byte as it was.
            for (const cell_copy& c : copies) storage_.copy_cell(c.src, c.dst);
            if (n > 0) head_ = out.cells.back() + 1 == capacity() ? 0 : out.cells.back() + 1;
            if (!first || staged_.empty()) cells_.release(cp.cells);  // an empty batch opens no transaction
            return out;
        } catch (...) {
            undo();
            head_ = head_in;
            throw;
        }
    }

    /// Writes K rows for the placed cells of one layer: rows holds cells.size() rows of
    /// n_head_kv x head_dim_k values (head-major), float, half or bfloat16 (kv_row_value),
    /// converted to the element type. Checks every argument before the first write, so a
    /// refusal (kvcache::error) writes nothing. Never allocates.
    template <kv_row_value R>
    void write_k(std::uint32_t layer, std::span<const std::uint32_t> cells, const R* rows) {
        check_write("write_k", layer, cells, rows == nullptr);
        write_rows<false>(layer, cells, rows);
    }
    /// Writes V rows (n_head_kv x head_dim_v values each) for the placed cells of one layer.
    template <kv_row_value R>
    void write_v(std::uint32_t layer, std::span<const std::uint32_t> cells, const R* rows) {
        check_write("write_v", layer, cells, rows == nullptr);
        write_rows<true>(layer, cells, rows);
    }
    /// Float rows (also taking nullptr with no cells).
    void write_k(std::uint32_t layer, std::span<const std::uint32_t> cells, const float* rows) {
        write_k<float>(layer, cells, rows);
    }
    void write_v(std::uint32_t layer, std::span<const std::uint32_t> cells, const float* rows) {
        write_v<float>(layer, cells, rows);
    }

    /// Whether placements are staged (a transaction is open).
    [[nodiscard]] bool in_transaction() const noexcept { return !staged_.empty(); }

    /// Makes every staged placement permanent. With nothing staged: returns nothing_staged.
    /// Never throws, except on a layout with a commit hook (ring: pruning moves cells,
    /// which allocates): a std::bad_alloc there leaves the transaction open and the cache
    /// as it was before the call.
    tx_result commit() noexcept(!has_capability<storage_t, layout_caps::commit_hook>) {
        if (staged_.empty()) return tx_result::nothing_staged;
        if constexpr (has_capability<storage_t, layout_caps::commit_hook>) {
            save_checkpoint(op_cp_);
            try {
                if constexpr (requires { storage_.on_commit(cells_, [](std::uint32_t) {}); })
                    storage_.on_commit(cells_, [this](std::uint32_t to) { guard_cell(to); });  // before its K/V copies
                else
                    storage_.on_commit(cells_);  // layout capability, e.g. SWA pruning
            } catch (...) {
                load_checkpoint(op_cp_);
                cells_.release(op_cp_.cells);
                throw;
            }
            cells_.release(op_cp_.cells);
        }
        end_tx();
        return tx_result::committed;
    }

    /// Puts the cache back exactly as it was before the first staged placement (cell
    /// metadata, indexes, the layout's tables and placement hints, the slot-search head);
    /// K/V bytes of occupied cells were never changed by placements. Never throws.
    /// With nothing staged: returns nothing_staged.
    tx_result restore() noexcept {
        if (staged_.empty()) return tx_result::nothing_staged;
        load_checkpoint(tx_cp_);
        for (const cell_backup& b : tx_backup_) put_cell_bytes(b);  // raw copies: never throws
        end_tx();
        return tx_result::restored;
    }

    /// Everything a rollback needs: a rollback point of the cell table (its changes since are
    /// journaled: cell_table::mark), a copy of the layout's tables, the slot-search head.
    /// Library components use it for compound operations (ops/, reuse/, io/). One saved
    /// through the internal API below ends (cell_table::release) when it is destroyed or saved
    /// again; it must not outlive its cache, nor see the cache moved while it is saved.
    struct checkpoint {
        cell_table::mark cells;
        std::unique_ptr<cell_observer> obs;
        std::uint32_t head = 0;

        checkpoint() = default;
        checkpoint(checkpoint&& o) noexcept
            : cells(std::move(o.cells)), obs(std::move(o.obs)), head(o.head), owner_(std::exchange(o.owner_, nullptr)) {}
        checkpoint& operator=(checkpoint&& o) noexcept {
            if (this != &o) {
                end();
                cells = std::move(o.cells);
                obs = std::move(o.obs);
                head = o.head;
                owner_ = std::exchange(o.owner_, nullptr);
            }
            return *this;
        }
        ~checkpoint() { end(); }
        /// Ends the rollback point now (keeps the cache as it is). Never throws.
        void end() noexcept {
            if (owner_ != nullptr) owner_->release(cells);
            owner_ = nullptr;
        }

    private:
        friend class basic_kv_cache;
        const cell_table* owner_ = nullptr;  // saved through save_checkpoint(cp, internal_access)
    };
    /// Saves the state into `cp` (may throw std::bad_alloc; nothing changed then). Changes
    /// are journaled from now until `cp` ends (destroyed, saved again, or cp.end()).
    void save_checkpoint(checkpoint& cp, detail::internal_access) const {
        if (cp.owner_ != nullptr && cp.owner_ != &cells_) cp.end();
        save_checkpoint(cp);
        cp.owner_ = &cells_;
    }
    /// Puts the state saved in `cp` back (once per save: `cp` then holds the discarded layout
    /// tables). Never throws. The checkpoints saved after `cp` are then void (only ended).
    /// Staged placements are not tracked: call it only with no transaction open, or on a
    /// checkpoint taken inside the same transaction.
    void load_checkpoint(checkpoint& cp, detail::internal_access) noexcept { load_checkpoint(cp); }
    /// Number of staged cells (a composite undoes one placement with it and a checkpoint).
    [[nodiscard]] std::size_t staged_count(detail::internal_access) const noexcept { return staged_.size(); }
    /// Undoes the placements made since `cp` was saved, when staged_count() was `n`. Never throws.
    void undo_place(checkpoint& cp, std::size_t n, detail::internal_access) noexcept {
        load_checkpoint(cp);
        staged_.resize(n);
        if (n == 0) end_tx();  // the transaction those placements opened is gone
    }

    /// The journal of a compound operation (slot_manager::prepare): a checkpoint, with
    /// the byte guard below.
    using journal_mark = checkpoint;
    void save_journal(journal_mark& m, detail::internal_access a) const { save_checkpoint(m, a); }
    void load_journal(journal_mark& m, detail::internal_access a) noexcept { load_checkpoint(m, a); }

    /// Byte guard of a compound operation (slot_manager::prepare): from begin_guard(cp) on,
    /// every cell that was occupied in checkpoint `cp` and is given out again (placements,
    /// splits, state loads, the ring's moves) has its K/V bytes copied first, so that
    /// load_checkpoint(cp) + rollback_guard() put the cache back bit-identical (occupied
    /// cells; free cells hold nothing). Costs at most the bytes written into such cells.
    /// `cp` must outlive the guard. begin_guard may throw std::bad_alloc (nothing changed).
    void begin_guard(const checkpoint& cp, detail::internal_access) {
        KVCACHE_ASSERT(cp.cells.is_live() && !guard_on_);
        static_cast<void>(cp);
        // Occupancy now, which is cp's (begin_guard follows the save): 1 = held, 2 = copied.
        guard_state_.resize(capacity());
        const pos_t* pos = cells_.pos_data();
        for (std::uint32_t c = 0; c < capacity(); ++c) guard_state_[c] = pos[c] >= 0 ? 1 : 0;
        guard_backup_.clear();
        guard_on_ = true;
    }
    /// Ends the guard, keeping the cache as it is now (drops the copies). Never throws.
    void end_guard(detail::internal_access) noexcept {
        guard_on_ = false;
        guard_backup_.clear();
    }
    /// Ends the guard, writing the kept bytes back (call after load_checkpoint(cp)). Never throws.
    void rollback_guard(detail::internal_access) noexcept {
        for (const cell_backup& b : guard_backup_) put_cell_bytes(b);
        end_guard(detail::internal_access{});
    }
    /// Copies the bytes of cells about to be written by a library component (state loads),
    /// when a guard is on. May throw std::bad_alloc before anything is written.
    void guard_cells(std::span<const std::uint32_t> cells, detail::internal_access) {
        guard_cells(cells);
    }

    // ------------------------------------------------------- sequence ops (F5)
    // Ranges are [p0, p1); p0 < 0 means 0, p1 < 0 means "to the end".
    // seq_id < 0 means every sequence where documented.
    // Every call validates all arguments first; on error the cache is unchanged.
    // Programming errors throw kvcache::error: invalid arguments (invalid_argument), a
    // call while placements are staged (transaction_open), a move of positions on a
    // layout that can never move them (unsupported, can_shift == false).
    // Expected runtime refusals come back as an error result<void>, nothing changed:
    // no free cell / block to split a shared cell (no_space), positions the layout
    // already dropped (unsupported: the ring's pruned positions).

    /// Removes sequence s (or every sequence if s < 0) from cells with position in [p0, p1).
    /// Error result: unsupported when the layout refuses (ring: pruned positions).
    [[nodiscard]] result<void> seq_rm(seq_id_t s, pos_t p0, pos_t p1) {
        check_no_tx("seq_rm");
        check_seq("seq_rm", "seq_id", s, true);
        const pos_range rg = range("seq_rm", p0, p1);  // no structured binding: clang 14 cannot capture one
        const std::int64_t lo = rg.lo, hi = rg.hi;
        if constexpr (has_capability<storage_t, layout_caps::seq_rm_check>)
            if (result<void> r = storage_.check_seq_rm(cells_, s, lo, hi); !r) return r;  // layout capability
        if (s >= 0 && !cells_.seq_has_pos_in(s, lo, hi)) return {};
        std::vector<std::uint32_t> hit;
        cells_.for_each_used([&](std::uint32_t c) {
            if (in_range(c, lo, hi) && (s < 0 || cells_.seqs(c).test(s))) hit.push_back(c);
        });
        if (hit.empty()) return {};
        return atomically([&]() -> result<void> {
            for (std::uint32_t c : hit) {
                if (s < 0)
                    cells_.free_cell(c);
                else
                    cells_.rm_seq(c, s);
            }
            return {};
        });
    }

    /// Adds sequence dst to every cell of src with position in [p0, p1), sharing the
    /// cells (no data copy). Throws invalid_argument if dst already holds one of those
    /// positions. Error result: unsupported when the layout refuses (ring: pruned positions).
    [[nodiscard]] result<void> seq_cp(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1) {
        check_no_tx("seq_cp");
        check_seq("seq_cp", "src", src, false);
        check_seq("seq_cp", "dst", dst, false);
        const pos_range rg = range("seq_cp", p0, p1);  // no structured binding: clang 14 cannot capture one
        const std::int64_t lo = rg.lo, hi = rg.hi;
        if (src == dst) return {};
        std::vector<std::uint32_t> hit;
        if (cells_.seq_has_pos_in(src, lo, hi))
            cells_.for_each_used([&](std::uint32_t c) {
                if (!in_range(c, lo, hi) || !cells_.seqs(c).test(src) || cells_.seqs(c).test(dst)) return;
                if (cells_.seq_has_pos(dst, cells_.pos(c)))
                    detail::fail(errc::invalid_argument,
                                 "seq_cp: destination sequence " + std::to_string(dst) + " already holds position " +
                                     std::to_string(cells_.pos(c)) + "; seq_rm it first");
                hit.push_back(c);
            });
        return atomically([&]() -> result<void> {
            if constexpr (has_capability<storage_t, layout_caps::seq_cp_hook>) {
                if (result<void> r = storage_.before_seq_cp(cells_, src, dst, lo, hi); !r) return r;  // may refuse
            } else if constexpr (has_capability<storage_t, layout_caps::seq_cp_check>) {
                if (result<void> r = storage_.check_seq_cp(cells_, src, dst, lo, hi); !r) return r;
            }
            for (std::uint32_t c : hit) cells_.add_seq(c, dst);
            return {};
        });
    }

    /// Removes every sequence other than s; cells not used by s become free.
    void seq_keep(seq_id_t s) {
        check_no_tx("seq_keep");
        check_seq("seq_keep", "seq_id", s, false);
        std::vector<std::uint32_t> hit(cells_.used_cells().begin(), cells_.used_cells().end());
        static_cast<void>(atomically([&]() -> result<void> {
            for (std::uint32_t c : hit) {
                if (!cells_.seqs(c).test(s)) {
                    cells_.free_cell(c);
                } else {
                    seq_set others = cells_.seqs(c);
                    others.reset(s);
                    others.for_each([&](seq_id_t t) { cells_.rm_seq(c, t); });
                }
            }
            return {};
        }));
    }

    /// Adds delta to the positions of sequence s (every sequence if s < 0) in [p0, p1).
    /// Cells moved below position 0 are removed. The K-shift delta accumulates per cell.
    /// A cell shared with another sequence is split first (the moving sequence gets its own
    /// copy of the K/V), so other sequences never see the move; needs one free cell per split
    /// (an errc::no_space result otherwise, nothing changed). Error result unsupported when
    /// the layout refuses (ring: pruned positions) or a cell would cross LongRoPE's
    /// rope.n_ctx_orig (rope_params::shift_exact). Throws unsupported when the layout can
    /// never move positions (can_shift == false), invalid_argument past position 2^31-1.
    /// M-RoPE caches: only the temporal position moves (and the K-shift rotates only the
    /// temporal section's pairs); each cell's extra positions (h, w, e) stay as placed.
    [[nodiscard]] result<void> seq_add(seq_id_t s, pos_t p0, pos_t p1, pos_t delta) {
        check_no_tx("seq_add");
        check_seq("seq_add", "seq_id", s, true);
        const pos_range rg = range("seq_add", p0, p1);  // no structured binding: clang 14 cannot capture one
        const std::int64_t lo = rg.lo, hi = rg.hi;
        require_shift("seq_add");
        if (delta == 0) return {};
        return atomically(
            [&] { return move_positions("seq_add", s, lo, hi, position_move{position_move::op::add, delta}); });
    }

    /// Integer-divides the positions of sequence s (every sequence if s < 0) in [p0, p1)
    /// by d > 0 (Self-Extend). Shared cells are split and refusals reported as in seq_add.
    [[nodiscard]] result<void> seq_div(seq_id_t s, pos_t p0, pos_t p1, int d) {
        check_no_tx("seq_div");
        check_seq("seq_div", "seq_id", s, true);
        const pos_range rg = range("seq_div", p0, p1);  // no structured binding: clang 14 cannot capture one
        const std::int64_t lo = rg.lo, hi = rg.hi;
        if (d <= 0) detail::fail(errc::invalid_argument, "seq_div: d = " + std::to_string(d) + ", must be > 0");
        require_shift("seq_div");
        if (d == 1) return {};
        return atomically([&] { return move_positions("seq_div", s, lo, hi, position_move{position_move::op::div, d}); });
    }

    /// Frees every cell and drops any staged placement. A throw (std::bad_alloc from the
    /// layout's tables) leaves everything as it was.
    void clear() {
        static_cast<void>(atomically([&]() -> result<void> {
            cells_.clear();
            return {};
        }));
        end_tx();  // placements staged before clear() are gone
        head_ = 0;
    }

    /// Whether some cell has a pending K-shift (apply it with ops::apply_k_shift).
    [[nodiscard]] bool has_shift() const noexcept { return cells_.n_shifted() != 0; }
    /// Forgets the pending shifts; called by the K-shift kernel after rotating K.
    void clear_shifts() noexcept { cells_.clear_shifts(); }
    /// Room for clear_shifts() in the journal of a live checkpoint (a K-shift run inside a
    /// compound operation); called before K is rotated. May throw std::bad_alloc.
    void reserve_clear_shifts(detail::internal_access) { cells_.reserve_clear_shifts(); }

    /// Mutable cell metadata for library components that rebuild cells wholesale
    /// (state loading, defragmentation). Not for host code: it bypasses validation
    /// and transactions. Refused while placements are staged.
    [[nodiscard]] cell_table& cells_for_update(detail::internal_access) {
        check_no_tx("cells_for_update");
        return cells_;
    }
    /// Resets the slot-search head (after a component rebuilt the cells).
    void reset_head(detail::internal_access) noexcept { head_ = 0; }

private:
    void save_checkpoint(checkpoint& cp) const {
        if (cell_observer* o = cells_.observer(); o != nullptr) {
            if (cp.obs)
                cp.obs->assign_from(*o);
            else
                cp.obs = o->clone();
        }
        cells_.save_mark(cp.cells);  // last: a throw above leaves no live mark
        cp.head = head_;
    }
    void load_checkpoint(checkpoint& cp) noexcept {
        cells_.rollback(cp.cells);
        if (cell_observer* o = cells_.observer(); o != nullptr) o->swap_state(*cp.obs);
        std::swap(head_, cp.head);
    }
    // The transaction is over (committed, restored or undone): its rollback point ends.
    void end_tx() noexcept {
        staged_.clear();
        tx_backup_.clear();
        tx_emptied_.clear();
        cells_.release(tx_cp_.cells);
    }
    /// Runs f (returning result<void>) with the strong guarantee: an error result or a
    /// throw puts everything back as before the call.
    template <class F>
    result<void> atomically(F&& f) {
        save_checkpoint(op_cp_);
        try {
            result<void> r = f();
            if (!r) load_checkpoint(op_cp_);
            cells_.release(op_cp_.cells);
            return r;
        } catch (...) {
            load_checkpoint(op_cp_);
            cells_.release(op_cp_.cells);
            throw;
        }
    }

    static const model_shape& validated(const model_shape& s) {
        s.validate();
        return s;
    }

    void check_seq(const char* fn, const std::string& name, seq_id_t s, bool allow_all) const {
        if (allow_all && s < 0) return;
        if (s < 0 || static_cast<std::uint32_t>(s) >= shape_.n_seq_max)
            detail::fail(errc::invalid_argument, std::string(fn) + ": " + name + " = " + std::to_string(s) +
                                                     (allow_all ? ", must be < 0 (all) or in [0, " : ", must be in [0, ") +
                                                     std::to_string(shape_.n_seq_max) + ")");
    }
    void check_layer_cell(const char* fn, std::uint32_t layer, std::uint32_t cell) const {
        if (layer >= shape_.n_layer)
            detail::fail(errc::invalid_argument, std::string(fn) + ": layer = " + std::to_string(layer) +
                                                     ", must be < n_layer = " + std::to_string(shape_.n_layer));
        if (cell >= capacity())
            detail::fail(errc::invalid_argument, std::string(fn) + ": cell = " + std::to_string(cell) +
                                                     ", must be < capacity = " + std::to_string(capacity()));
    }
    void check_write(const char* fn, std::uint32_t layer, std::span<const std::uint32_t> cells, bool null_rows) const {
        if (!cells.empty() && null_rows)
            detail::fail(errc::invalid_argument, std::string(fn) + ": rows is null");
        for (std::uint32_t c : cells) {
            check_layer_cell(fn, layer, c);
            if (cells_.is_free(c))
                detail::fail(errc::invalid_argument,
                             std::string(fn) + ": cell " + std::to_string(c) + " is free; place the batch first");
        }
        if (cells.empty()) check_layer_cell(fn, layer, 0);
    }
    // write_k / write_v after their checks: 16-bit rows widened one at a time into row_buf_.
    template <bool IsV, class R>
    void write_rows(std::uint32_t layer, std::span<const std::uint32_t> cells, const R* rows) {
        const std::size_t n = IsV ? shape_.v_row_size() : shape_.k_row_size();
        for (std::size_t i = 0; i < cells.size(); ++i) {
            const float* row;
            if constexpr (std::is_same_v<R, float>) {
                row = rows + i * n;
            } else {
                detail::widen_row(rows + i * n, row_buf_.data(), n);
                row = row_buf_.data();
            }
            if constexpr (IsV)
                storage_.write_v(layer, cells[i], row);
            else
                storage_.write_k(layer, cells[i], row);
        }
    }
    void check_ext(std::size_t n, std::span<const mrope_pos> ext) const {
        if (shape_.rope.mrope.on()) {
            if (ext.size() != n)
                detail::fail(errc::invalid_argument,
                             "place: this cache's shape has M-RoPE sections (rope.mrope), so every token needs its "
                             "extra positions (h, w, e): ext has " + std::to_string(ext.size()) + " entries for " +
                                 std::to_string(n) + " tokens");
            for (std::size_t i = 0; i < n; ++i)
                if (ext[i].h < 0 || ext[i].w < 0 || ext[i].e < 0)
                    detail::fail(errc::invalid_argument,
                                 "place: ext[" + std::to_string(i) + "] = (" + std::to_string(ext[i].h) + ", " +
                                     std::to_string(ext[i].w) + ", " + std::to_string(ext[i].e) +
                                     "), M-RoPE positions must be >= 0");
        } else if (!ext.empty()) {
            detail::fail(errc::invalid_argument, "place: ext has " + std::to_string(ext.size()) +
                                                     " M-RoPE extra positions but this cache's shape has no "
                                                     "M-RoPE sections (rope.mrope); pass none");
        }
    }
    void check_no_tx(const char* fn) const {
        if (!staged_.empty())
            detail::fail(errc::transaction_open,
                         std::string(fn) + ": placements are staged; commit() or restore() first");
    }
    void check_no_foreign_seqs(std::span<const seq_set> seqs) const {
        for (std::size_t i = 0; i < seqs.size(); ++i) {
            if (seqs[i].none())
                detail::fail(errc::invalid_argument, "place: token " + std::to_string(i) + " has no sequence");
            seqs[i].for_each([&](seq_id_t s) { check_seq("place", "sequence of token " + std::to_string(i), s, false); });
        }
    }
    void validate_batch(std::span<const pos_t> pos, std::span<const seq_set> seqs) const {
        if (pos.size() != seqs.size())
            detail::fail(errc::invalid_argument, "place: pos has " + std::to_string(pos.size()) +
                                                     " entries but seqs has " + std::to_string(seqs.size()));
        std::vector<std::pair<seq_id_t, pos_t>> pairs;
        pairs.reserve(pos.size());
        for (std::size_t i = 0; i < pos.size(); ++i) {
            if (pos[i] < 0)
                detail::fail(errc::invalid_argument,
                             "place: pos[" + std::to_string(i) + "] = " + std::to_string(pos[i]) + ", must be >= 0");
            seqs[i].for_each([&](seq_id_t s) {
                if (cells_.seq_has_pos(s, pos[i]))
                    detail::fail(errc::invalid_argument, "place: sequence " + std::to_string(s) +
                                                             " already holds position " + std::to_string(pos[i]) +
                                                             " (token " + std::to_string(i) + "); seq_rm it first");
                pairs.emplace_back(s, pos[i]);
            });
        }
        std::vector<std::pair<seq_id_t, pos_t>> in_order = pairs;  // batch order within each sequence
        std::sort(pairs.begin(), pairs.end());
        const auto dup = std::adjacent_find(pairs.begin(), pairs.end());
        if (dup != pairs.end())
            detail::fail(errc::invalid_argument, "place: the batch puts sequence " + std::to_string(dup->first) +
                                                     " at position " + std::to_string(dup->second) + " twice");
        // Batch position rule: the positions of a sequence that holds cells increase in batch
        // order, after its last position (gaps allowed); an empty sequence takes any
        // distinct positions (a new prompt, or a saved sequence put back in cell order).
        std::stable_sort(in_order.begin(), in_order.end(),
                         [](const auto& x, const auto& y) { return x.first < y.first; });
        for (std::size_t i = 0; i < in_order.size(); ++i) {
            const auto [s, p] = in_order[i];
            if (cells_.seq_pos_max(s) < 0) continue;  // empty: any distinct positions
            const bool first = i == 0 || in_order[i - 1].first != s;
            const pos_t last = first ? cells_.seq_pos_max(s) : in_order[i - 1].second;
            if (p <= last)
                detail::fail(errc::invalid_argument,
                             "place: sequence " + std::to_string(s) + " gets position " + std::to_string(p) +
                                 (first ? " but its last position in the cache is "
                                        : " right after position ") +
                                 std::to_string(last) + "; a sequence's positions in a batch must increase, after "
                                 "its last position (expected > " + std::to_string(last) + ")");
        }
    }

    /// F3: n free cells starting at head_ (wrapping); if head_ > used + 2n, search from 0.
    /// Precondition: n <= free cells.
    std::vector<std::uint32_t> find_free_cells(std::uint32_t n) {
        std::vector<std::uint32_t> out;
        out.reserve(n);
        if (head_ > cells_.used() + 2u * n) head_ = 0;
        const std::uint32_t cap = capacity();
        for (std::uint32_t k = 0; k < cap && out.size() < n; ++k) {
            const std::uint32_t c = head_ + k < cap ? head_ + k : head_ + k - cap;
            if (cells_.is_free(c)) out.push_back(c);
        }
        KVCACHE_ASSERT(out.size() == n);
        return out;
    }

    struct pos_range {
        std::int64_t lo, hi;
    };
    static pos_range range(const char* fn, pos_t p0, pos_t p1) {
        const std::int64_t lo = p0 < 0 ? 0 : p0;
        const std::int64_t hi = p1 < 0 ? std::int64_t{std::numeric_limits<pos_t>::max()} + 1 : p1;
        if (lo > hi)
            detail::fail(errc::invalid_argument, std::string(fn) + ": reversed range [p0, p1) = [" +
                                                     std::to_string(p0) + ", " + std::to_string(p1) + ")");
        return {lo, hi};
    }
    bool in_range(std::uint32_t c, std::int64_t lo, std::int64_t hi) const noexcept {
        return cells_.pos(c) >= lo && cells_.pos(c) < hi;
    }
    void require_shift(const char* fn) const {
        if constexpr (!layout::can_shift)
            detail::fail(errc::unsupported, std::string(fn) + ": the " + std::string(layout::name) +
                                                " layout cannot move positions");
    }

    /// Shared implementation of seq_add / seq_div: new position = f(old) as int64.
    result<void> move_positions(const char* fn, seq_id_t s, std::int64_t lo, std::int64_t hi, position_move f) {
        std::vector<std::uint32_t> hit;
        std::uint32_t splits = 0;
        if (s < 0 || cells_.seq_has_pos_in(s, lo, hi))
            cells_.for_each_used([&](std::uint32_t c) {
                if (!in_range(c, lo, hi) || (s >= 0 && !cells_.seqs(c).test(s))) return;
                const std::int64_t np = f(cells_.pos(c));
                if (np > std::numeric_limits<pos_t>::max())
                    detail::fail(errc::invalid_argument, std::string(fn) + ": position " +
                                                             std::to_string(cells_.pos(c)) + " would move to " +
                                                             std::to_string(np) + ", beyond the largest position 2^31-1");
                if (np == cells_.pos(c)) return;
                hit.push_back(c);
                if (s >= 0 && np >= 0 && cells_.seqs(c).count() > 1) ++splits;
            });
        for (std::uint32_t c : hit) {  // LongRoPE: K rotated with one table cannot move to the other's positions
            const std::int64_t from = std::int64_t{cells_.pos(c)} - cells_.shift(c), np = f(cells_.pos(c));
            if (np >= 0 && !shape_.rope.shift_exact(from, np))
                return detail::make_error(errc::unsupported,
                                          std::string(fn) + ": position " + std::to_string(cells_.pos(c)) +
                                              " (K rotated at " + std::to_string(from) + ") would move to " +
                                              std::to_string(np) + ", across LongRoPE's n_ctx_orig = " +
                                              std::to_string(shape_.rope.n_ctx_orig) +
                                              " where the factor table changes; the K-shift cannot make that exact");
        }
        if constexpr (has_capability<storage_t, layout_caps::seq_shift_check>)
            if (result<void> r = storage_.check_seq_shift(cells_, fn, s, lo, hi, f); !r)
                return r;  // layout capability (ring: pruned positions)
        if (splits > cells_.free_count())
            return detail::make_error(errc::no_space, std::string(fn) + ": moving sequence " + std::to_string(s) +
                                                          " needs " + std::to_string(splits) +
                                                          " free cells to split shared cells, " +
                                                          std::to_string(cells_.free_count()) + " free");
        // Split targets: the lowest free cells before the operation, in order of the cells split.
        std::vector<std::uint32_t> targets;
        targets.reserve(splits);
        if constexpr (has_capability<storage_t, layout_caps::split_targets>) {
            result<std::vector<std::uint32_t>> t = storage_.split_targets(cells_, s, splits);  // paged: no_space
            if (!t) return detail::make_error(t.code(), std::string(fn) + ": " + t.message());
            targets = std::move(t).value();
        } else
            for (std::uint32_t c = 0; targets.size() < splits; ++c)
                if (cells_.is_free(c)) targets.push_back(c);
        std::size_t next_target = 0;
        std::vector<std::pair<std::uint32_t, std::uint32_t>> copies;  // K/V copied last: never throws
        copies.reserve(splits);
        for (std::uint32_t c : hit) {
            const std::int64_t np = f(cells_.pos(c));
            if (np < 0) {
                if (s < 0)
                    cells_.free_cell(c);
                else
                    cells_.rm_seq(c, s);
                continue;
            }
            std::uint32_t target = c;
            if (s >= 0 && cells_.seqs(c).count() > 1) {  // split: s gets its own copy
                target = targets[next_target++];
                guard_cell(target);
                copies.emplace_back(c, target);
                cells_.rm_seq(c, s);
                cells_.occupy(target, cells_.pos(c), seq_set::of(s), cells_.ext(c));
                cells_.set_shift(target, cells_.shift(c));
            }
            cells_.move_pos(target, static_cast<pos_t>(np));
        }
        for (const auto& [from, to] : copies) storage_.copy_cell(from, to);
        return {};
    }

    /// K and V bytes of one cell, every layer (a cell's state at the start of a transaction).
    struct cell_backup {
        std::uint32_t cell = 0;
        std::vector<storage_type> bytes;  // per layer: K (head, storage unit), then V (head, storage unit)
    };
    void backup_if_held_at_tx_start(std::uint32_t c) {
        if (std::find(tx_emptied_.begin(), tx_emptied_.end(), c) == tx_emptied_.end()) return;
        for (const cell_backup& b : tx_backup_)
            if (b.cell == c) return;  // the first copy is the transaction's start
        tx_backup_.push_back(cell_bytes(c));
    }
    /// The guard's copy of cell c (begin_guard), once: the bytes it had when the guard began.
    void guard_cell(std::uint32_t c) {
        if (!guard_on_ || guard_state_[c] != 1) return;
        guard_backup_.push_back(cell_bytes(c));
        guard_state_[c] = 3;
    }
    void guard_cells(std::span<const std::uint32_t> cells) {
        if (!guard_on_) return;
        guard_backup_.reserve(guard_backup_.size() + cells.size());
        for (const std::uint32_t c : cells) guard_cell(c);
    }
    cell_backup cell_bytes(std::uint32_t c) const {
        cell_backup b;
        b.cell = c;
        for (std::uint32_t l = 0; l < shape_.n_layer; ++l) {
            const auto v = storage_.view(l);
            if (l == 0) b.bytes.reserve(std::size_t{shape_.n_layer} * shape_.n_head_kv * (v.k_units() + v.v_units()));
            for (std::uint32_t h = 0; h < shape_.n_head_kv; ++h)
                for (std::uint32_t u = 0; u < v.k_units(); ++u) b.bytes.push_back(v.k[v.k_unit(h, c, u)]);
            for (std::uint32_t h = 0; h < shape_.n_head_kv; ++h)
                for (std::uint32_t u = 0; u < v.v_units(); ++u) b.bytes.push_back(v.v[v.v_unit(h, c, u)]);
        }
        return b;
    }
    void put_cell_bytes(const cell_backup& b) noexcept {
        std::size_t i = 0;
        for (std::uint32_t l = 0; l < shape_.n_layer; ++l) {
            const auto v = storage_.view(l);
            for (std::uint32_t h = 0; h < shape_.n_head_kv; ++h)
                for (std::uint32_t u = 0; u < v.k_units(); ++u) v.k[v.k_unit(h, b.cell, u)] = b.bytes[i++];
            for (std::uint32_t h = 0; h < shape_.n_head_kv; ++h)
                for (std::uint32_t u = 0; u < v.v_units(); ++u) v.v[v.v_unit(h, b.cell, u)] = b.bytes[i++];
        }
    }

    model_shape shape_;
    cell_table cells_;
    storage_t storage_;
    std::vector<std::uint32_t> staged_;  // cells placed since the last commit, in order
    std::vector<cell_backup> tx_backup_;  // cells given out again in this transaction (restore())
    std::uint32_t head_ = 0;             // where the next slot search starts (F3)
    checkpoint tx_cp_;                   // the state before the first staged placement (restore())
    checkpoint op_cp_;                   // the state before the running operation (its rollback)
    std::vector<std::uint32_t> tx_emptied_;  // cells this transaction emptied that held K/V when it began
    bool guard_on_ = false;              // a byte guard is on (begin_guard)
    std::vector<std::uint8_t> guard_state_;  // per cell: 1 held when the guard began, 3 also copied
    std::vector<cell_backup> guard_backup_;
    std::vector<float> row_buf_ = std::vector<float>(std::max(shape_.k_row_size(), shape_.v_row_size()));  // write_rows
};

static_assert(memory<kv_cache<>> && kv_memory<kv_cache<>>, "kvcache: kv_cache must satisfy kvcache::kv_memory");

KVCACHE_END_NAMESPACE
