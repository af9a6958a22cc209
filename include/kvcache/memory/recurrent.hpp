// kvcache: recurrent_memory, the state memory of recurrent layers (F17): Mamba/RWKV
// models and the recurrent layers of hybrid models (Jamba, Granite 4, Falcon-H1,
// Nemotron-H). Semantics as llama.cpp's llama_memory_recurrent, with refusals reported
// instead of silently dropped.
//
// A recurrent layer does not keep one K/V row per token: it keeps one state per
// sequence, updated token by token. Per sequence (slot s = sequence id s, n_seq_max
// slots) and per recurrent layer the memory holds
//   - a convolution state: (d_conv - 1) rows of d_inner floats, the last inputs of the
//     layer's short causal convolution (row 0 the oldest);
//   - an SSM / recurrent state: ssm_size floats in whatever shape the layer uses
//     (Mamba: d_state x d_inner; Mamba-2 and gated delta nets: heads x d_state x head_dim).
// Every state is f32, in one buffer allocated by the constructor and zeroed; an empty
// sequence's state is all zeros (the initial state of a recurrent layer), which every
// operation keeps.
//
// Positions: a sequence holds one state that summarises every token it was given, and
// the interval [seq_pos_min, seq_pos_max] of their positions (-1, -1 when empty). The
// memory treats the sequence as holding every position of that interval.
//
// Placement (F3, F4): place(pos, seq) checks the batch position rule (the positions of a
// sequence increase in batch order, after its last position; gaps allowed), extends the
// sequences' intervals and returns where each token's state lives (its sequence's slot).
// The engine then runs the recurrent layers over the batch, token by token per sequence,
// reading and writing conv_state(l, s) / ssm_state(l, s). The first placement of a
// transaction that touches a sequence snapshots its state and interval: restore() puts
// the bytes and positions of every touched sequence back, commit() drops the snapshots.
// Write only the states of sequences the open transaction placed. A placement never
// runs out of room (every sequence has its slot), so place() refuses only invalid
// arguments (thrown).
//
// Sequence operations (F5), each complete or refused with nothing changed. A state
// cannot be rolled back to an earlier position, nor forget its first tokens, so an
// operation that would cut a sequence's interval is refused with an error result
// (errc::unsupported, "refused by history"):
//   - seq_rm(s, p0, p1): removes nothing if [p0, p1) misses the interval, clears the
//     sequence (state zeroed) if it covers it, refuses otherwise. A slot that kept a
//     checkpoint of the state at the position it wants (take_checkpoint) puts it back
//     with restore_checkpoint instead.
//   - seq_cp(src, dst, p0, p1): copies src's state and interval into dst when [p0, p1)
//     covers src's interval (nothing when it misses it, refused when it cuts it). dst
//     must be empty: two states cannot be merged (invalid_argument otherwise).
//   - seq_keep(s), clear(): empty every other sequence / every sequence.
//   - seq_add / seq_div: a recurrent state has no RoPE, so moving positions only
//     relabels the interval (can_shift is true, has_shift() is always false). The range
//     must cover the interval or miss it; an interval moved wholly below 0 clears the
//     sequence, partly below 0 is refused (the state cannot forget those tokens).
// As on kv_cache, negative sequence ids mean every sequence for seq_rm / seq_add /
// seq_div (checked for every sequence before any changes), invalid arguments and calls
// while placements are staged throw kvcache::error.
//
// State files: io/recurrent.hpp (io::save_state / load_state / save_seq / load_seq
// overloads for recurrent_memory). Checkpoints for prefix reuse: take_checkpoint /
// restore_checkpoint below (hooks for hosts and tests). slot_manager (prompt/slots.hpp)
// keeps its own checkpoints of a slot's whole sequence (the io::save_seq bytes, kept by
// state_store and saved with the global prompt-cache entry) at the positions its options
// ask for, and prepare() resumes from the newest one at or below the common prefix.
// Prefix reuse is exact-prefix only (reuse policy reuse::lcp, or the attention part's
// for hybrid_memory, without chunk moves): a recurrent state summarises its tokens in
// order, so chunks cannot be moved into place (chunk reuse, F20, is off); reuse::apply_plan
// below truncates nothing it would have to roll back.
#pragma once

#include <algorithm>  // std::fill, std::copy
#include <cstddef>    // std::size_t
#include <cstdint>    // fixed-width integers
#include <limits>     // position limits
#include <span>       // state views, batch inputs
#include <string>     // messages
#include <vector>     // buffers

#include "../detail/policy_select.hpp"
#include "../error.hpp"
#include "../model_shape.hpp"
#include "../reuse/lcp.hpp"
#include "../reuse/plan.hpp"
#include "memory.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Shape of a recurrent_memory: the recurrent layers' state sizes and the sequences.
struct recurrent_shape {
    std::uint32_t n_layer = 0;    ///< recurrent layers (the memory's layer ids are 0..n_layer-1)
    std::uint32_t n_seq_max = 1;  ///< sequences (state slots), in [1, KVCACHE_MAX_SEQ]
    std::uint32_t d_conv = 4;     ///< convolution kernel width (>= 1); the conv state keeps d_conv - 1 rows
    std::uint32_t d_inner = 0;    ///< channels of the convolution (floats per conv row)
    std::uint32_t ssm_size = 0;   ///< floats of the SSM / recurrent state per layer and sequence

    /// Floats of one layer's convolution state: (d_conv - 1) * d_inner.
    [[nodiscard]] std::size_t conv_floats() const noexcept {
        return d_conv == 0 ? 0 : std::size_t{d_conv - 1} * d_inner;
    }
    /// Floats of one layer's states (conv then SSM) for one sequence.
    [[nodiscard]] std::size_t layer_floats() const noexcept { return conv_floats() + ssm_size; }
    /// Floats of one sequence's states over every layer.
    [[nodiscard]] std::size_t seq_floats() const noexcept { return layer_floats() * n_layer; }

    /// Throws kvcache::error(invalid_config) naming the first bad field.
    void validate() const {
        auto bad = [](const char* f, std::uint64_t v, const char* rule) {
            detail::fail(errc::invalid_config,
                         std::string("recurrent_shape.") + f + " = " + std::to_string(v) + ", " + rule);
        };
        if (n_layer == 0) bad("n_layer", n_layer, "must be >= 1");
        if (n_seq_max == 0 || n_seq_max > KVCACHE_MAX_SEQ) bad("n_seq_max", n_seq_max, "must be in [1, KVCACHE_MAX_SEQ]");
        if (d_conv == 0) bad("d_conv", d_conv, "must be >= 1 (1: no convolution state)");
        if (d_conv > 1 && d_inner == 0) bad("d_inner", d_inner, "must be >= 1 when d_conv > 1");
        if (conv_floats() == 0 && ssm_size == 0)
            bad("ssm_size", ssm_size, "must be >= 1 when there is no convolution state (d_conv = 1)");
        // 2^40 floats (4 TiB) bounds every product below.
        constexpr std::uint64_t limit = std::uint64_t{1} << 40;
        const std::uint64_t conv = std::uint64_t{d_conv - 1} * d_inner;
        if (conv > limit || conv + ssm_size > limit / n_layer || (conv + ssm_size) * n_layer > limit / n_seq_max)
            bad("ssm_size", ssm_size, "makes the state buffer larger than 2^40 floats");
    }
};

/// Where one placed micro-batch lives in a recurrent_memory.
struct recurrent_placement {
    std::vector<seq_id_t> slots;  ///< slots[i]: the state slot of token i (its sequence)
    std::vector<seq_id_t> seqs;   ///< the distinct sequences of the batch, in order of first token
};

/// One sequence's state and interval, kept outside the memory (prefix-reuse checkpoints).
struct recurrent_checkpoint {
    pos_t pos_min = -1;
    pos_t pos_max = -1;
    std::vector<float> state;  ///< recurrent_shape::seq_floats() floats, layer by layer: conv then SSM
};

/// State memory of recurrent layers (see the file comment).
/// Thread safety: as kv_cache (concurrent const calls safe, mutation exclusive).
class recurrent_memory {
public:
    using memory_concept = memory_tag;  // opts in to kvcache::memory (memory.hpp)
    using placement_type = recurrent_placement;
    /// Moving positions relabels a state's interval (no RoPE): always allowed.
    static constexpr bool can_shift = true;
    /// Reuse policy of slot_manager: exact prefix (no chunk moves; see the file comment).
    using reuse = ::kvcache::reuse::lcp;

    /// Allocates and zeroes every state. Throws kvcache::error(invalid_config) naming a bad field.
    explicit recurrent_memory(const recurrent_shape& s)
        : shape_(validated(s)),
          data_(s.seq_floats() * s.n_seq_max, 0.0f),
          pos_min_(s.n_seq_max, -1),
          pos_max_(s.n_seq_max, -1),
          touched_(s.n_seq_max, 0) {}

    [[nodiscard]] const recurrent_shape& shape() const noexcept { return shape_; }
    [[nodiscard]] std::uint32_t n_layer() const noexcept { return shape_.n_layer; }
    [[nodiscard]] std::uint32_t n_seq_max() const noexcept { return shape_.n_seq_max; }

    // ------------------------------------------------------------------ states

    /// Convolution state of recurrent layer l for sequence s: (d_conv - 1) rows of d_inner floats.
    [[nodiscard]] std::span<float> conv_state(std::uint32_t l, seq_id_t s) {
        return {layer_ptr("conv_state", l, s), shape_.conv_floats()};
    }
    [[nodiscard]] std::span<const float> conv_state(std::uint32_t l, seq_id_t s) const {
        return {layer_ptr("conv_state", l, s), shape_.conv_floats()};
    }
    /// SSM / recurrent state of recurrent layer l for sequence s: ssm_size floats.
    [[nodiscard]] std::span<float> ssm_state(std::uint32_t l, seq_id_t s) {
        return {layer_ptr("ssm_state", l, s) + shape_.conv_floats(), shape_.ssm_size};
    }
    [[nodiscard]] std::span<const float> ssm_state(std::uint32_t l, seq_id_t s) const {
        return {layer_ptr("ssm_state", l, s) + shape_.conv_floats(), shape_.ssm_size};
    }
    /// Every state of sequence s (seq_floats() floats, layer by layer: conv then SSM).
    [[nodiscard]] std::span<const float> seq_state(seq_id_t s) const {
        check_seq("seq_state", "seq_id", s, false);
        return {seq_ptr(s), shape_.seq_floats()};
    }

    // --------------------------------------------------------------- positions

    /// Smallest position of sequence s (-1: empty).
    [[nodiscard]] pos_t seq_pos_min(seq_id_t s) const {
        check_seq("seq_pos_min", "seq_id", s, false);
        return pos_min_[static_cast<std::size_t>(s)];
    }
    /// Largest position of sequence s (-1: empty).
    [[nodiscard]] pos_t seq_pos_max(seq_id_t s) const {
        check_seq("seq_pos_max", "seq_id", s, false);
        return pos_max_[static_cast<std::size_t>(s)];
    }
    /// Bytes of the state buffer (allocated once). A transaction's snapshots are extra,
    /// temporary memory: at most the states of the sequences it placed.
    [[nodiscard]] std::size_t total_bytes() const noexcept { return data_.size() * sizeof(float); }
    /// A recurrent state has no K to rotate: never a pending shift.
    [[nodiscard]] bool has_shift() const noexcept { return false; }

    // -------------------------------------------------------- placement (F3, F4)

    [[nodiscard]] bool in_transaction() const noexcept { return in_tx_; }

    /// Places a micro-batch: token i continues sequence seq[i] at position pos[i]. Throws
    /// kvcache::error(invalid_argument) for sizes that differ, a sequence out of range, a
    /// negative position, or positions of a sequence that do not increase after its last
    /// position (nothing changed). Never refuses otherwise.
    [[nodiscard]] result<recurrent_placement> place(std::span<const pos_t> pos, std::span<const seq_id_t> seq) {
        if (pos.size() != seq.size())
            detail::fail(errc::invalid_argument, "place: pos has " + std::to_string(pos.size()) +
                                                     " entries but seq has " + std::to_string(seq.size()));
        recurrent_placement out;
        out.slots.assign(seq.begin(), seq.end());
        std::vector<pos_t> last(pos_max_);  // per sequence: the last position so far
        std::vector<pos_t> first(pos_min_);
        for (std::size_t i = 0; i < pos.size(); ++i) {
            const seq_id_t s = seq[i];
            check_seq("place", "seq[" + std::to_string(i) + "]", s, false);
            if (pos[i] < 0)
                detail::fail(errc::invalid_argument,
                             "place: pos[" + std::to_string(i) + "] = " + std::to_string(pos[i]) + ", must be >= 0");
            const auto u = static_cast<std::size_t>(s);
            if (pos[i] <= last[u])
                detail::fail(errc::invalid_argument,
                             "place: sequence " + std::to_string(s) + " gets position " + std::to_string(pos[i]) +
                                 " (token " + std::to_string(i) + ") after position " + std::to_string(last[u]) +
                                 "; a recurrent sequence's positions must increase, after its last position");
            if (last[u] == pos_max_[u]) out.seqs.push_back(s);  // first token of s in the batch
            if (first[u] < 0) first[u] = pos[i];
            last[u] = pos[i];
        }
        if (pos.empty()) return out;
        // Snapshot the sequences this transaction places for the first time (may throw
        // std::bad_alloc: nothing changed then), then apply the intervals (cannot throw).
        std::size_t n_new = 0;
        for (seq_id_t s : out.seqs) n_new += touched_[static_cast<std::size_t>(s)] == 0;
        backups_.reserve(backups_.size() + n_new);
        backup_data_.reserve(backup_data_.size() + n_new * shape_.seq_floats());
        for (seq_id_t s : out.seqs) {
            const auto u = static_cast<std::size_t>(s);
            if (touched_[u] != 0) continue;
            touched_[u] = 1;
            backups_.push_back({s, pos_min_[u], pos_max_[u]});
            backup_data_.insert(backup_data_.end(), seq_ptr(s), seq_ptr(s) + shape_.seq_floats());
        }
        for (seq_id_t s : out.seqs) {
            const auto u = static_cast<std::size_t>(s);
            pos_min_[u] = first[u];
            pos_max_[u] = last[u];
        }
        in_tx_ = true;
        return out;
    }

    /// Makes the staged placements (and the states written since) permanent.
    tx_result commit() noexcept {
        if (!in_tx_) return tx_result::nothing_staged;
        drop_backups();
        return tx_result::committed;
    }
    /// Puts the state bytes and intervals of every sequence placed since the last
    /// commit back. Never throws.
    tx_result restore() noexcept {
        if (!in_tx_) return tx_result::nothing_staged;
        const std::size_t n = shape_.seq_floats();
        for (std::size_t i = 0; i < backups_.size(); ++i) {
            const backup& b = backups_[i];
            std::copy(backup_data_.begin() + static_cast<std::ptrdiff_t>(i * n),
                      backup_data_.begin() + static_cast<std::ptrdiff_t>((i + 1) * n), seq_ptr(b.seq));
            pos_min_[static_cast<std::size_t>(b.seq)] = b.pos_min;
            pos_max_[static_cast<std::size_t>(b.seq)] = b.pos_max;
        }
        drop_backups();
        return tx_result::restored;
    }

    // --------------------------------------------------------- sequence ops (F5)
    // Ranges are [p0, p1); p0 < 0 means 0, p1 < 0 means "to the end".

    /// Removes positions [p0, p1) of sequence s (every sequence if s < 0): clears a
    /// sequence whose interval the range covers, leaves one it misses, and refuses
    /// (errc::unsupported, nothing changed) when the range cuts an interval.
    [[nodiscard]] result<void> seq_rm(seq_id_t s, pos_t p0, pos_t p1) {
        check_no_tx("seq_rm");
        check_seq("seq_rm", "seq_id", s, true);
        const range r = make_range("seq_rm", p0, p1);
        for (seq_id_t t : targets(s))
            if (overlap(t, r) == cover::part) return refused_by_history("seq_rm", t, r, "remove");
        for (seq_id_t t : targets(s))
            if (overlap(t, r) == cover::all) guard_seq(t);  // may throw: nothing changed yet
        for (seq_id_t t : targets(s))
            if (overlap(t, r) == cover::all) empty_seq(t);
        return {};
    }

    /// Copies src's state and interval into dst when [p0, p1) covers src's interval (a
    /// range that misses it copies nothing; one that cuts it is refused, errc::unsupported).
    /// Throws invalid_argument when dst already holds a state (seq_rm it first).
    [[nodiscard]] result<void> seq_cp(seq_id_t src, seq_id_t dst, pos_t p0, pos_t p1) {
        check_no_tx("seq_cp");
        check_seq("seq_cp", "src", src, false);
        check_seq("seq_cp", "dst", dst, false);
        const range r = make_range("seq_cp", p0, p1);
        if (src == dst) return {};
        const cover c = overlap(src, r);
        if (c == cover::none) return {};
        if (pos_max_[static_cast<std::size_t>(dst)] >= 0)
            detail::fail(errc::invalid_argument,
                         "seq_cp: destination sequence " + std::to_string(dst) + " already holds a state (positions [" +
                             std::to_string(pos_min_[static_cast<std::size_t>(dst)]) + ", " +
                             std::to_string(pos_max_[static_cast<std::size_t>(dst)]) +
                             "]); two recurrent states cannot be merged: seq_rm it first");
        if (c == cover::part) return refused_by_history("seq_cp", src, r, "copy");
        guard_seq(dst);
        std::copy(seq_ptr(src), seq_ptr(src) + shape_.seq_floats(), seq_ptr(dst));
        pos_min_[static_cast<std::size_t>(dst)] = pos_min_[static_cast<std::size_t>(src)];
        pos_max_[static_cast<std::size_t>(dst)] = pos_max_[static_cast<std::size_t>(src)];
        return {};
    }

    /// Empties every sequence other than s.
    void seq_keep(seq_id_t s) {
        check_no_tx("seq_keep");
        check_seq("seq_keep", "seq_id", s, false);
        for (seq_id_t t = 0; static_cast<std::uint32_t>(t) < shape_.n_seq_max; ++t)
            if (t != s) guard_seq(t);
        for (seq_id_t t = 0; static_cast<std::uint32_t>(t) < shape_.n_seq_max; ++t)
            if (t != s) empty_seq(t);
    }

    /// Adds delta to the positions of s (every sequence if s < 0) in [p0, p1): moves an
    /// interval the range covers (clears it if it ends below 0). Refused (errc::unsupported,
    /// nothing changed) when the range cuts an interval or moves part of it below 0.
    /// Throws invalid_argument past position 2^31-1.
    [[nodiscard]] result<void> seq_add(seq_id_t s, pos_t p0, pos_t p1, pos_t delta) {
        check_no_tx("seq_add");
        check_seq("seq_add", "seq_id", s, true);
        const range r = make_range("seq_add", p0, p1);
        if (delta == 0) return {};
        return move("seq_add", s, r, [delta](std::int64_t p) { return p + delta; });
    }

    /// Integer-divides the positions of s (every sequence if s < 0) in [p0, p1) by d > 0
    /// (Self-Extend); refusals as seq_add.
    [[nodiscard]] result<void> seq_div(seq_id_t s, pos_t p0, pos_t p1, int d) {
        check_no_tx("seq_div");
        check_seq("seq_div", "seq_id", s, true);
        const range r = make_range("seq_div", p0, p1);
        if (d <= 0) detail::fail(errc::invalid_argument, "seq_div: d = " + std::to_string(d) + ", must be > 0");
        if (d == 1) return {};
        return move("seq_div", s, r, [d](std::int64_t p) { return p / d; });
    }

    /// Empties every sequence (states zeroed) and drops any staged placement.
    void clear() noexcept {
        std::fill(data_.begin(), data_.end(), 0.0f);
        std::fill(pos_min_.begin(), pos_min_.end(), -1);
        std::fill(pos_max_.begin(), pos_max_.end(), -1);
        drop_backups();
    }

    // ------------------------------------------------------------- checkpoints

    /// Copies sequence s's state and interval (for prefix reuse: a slot keeps it and
    /// later puts it back with restore_checkpoint).
    [[nodiscard]] recurrent_checkpoint take_checkpoint(seq_id_t s) const {
        check_seq("take_checkpoint", "seq_id", s, false);
        recurrent_checkpoint cp;
        cp.pos_min = pos_min_[static_cast<std::size_t>(s)];
        cp.pos_max = pos_max_[static_cast<std::size_t>(s)];
        cp.state.assign(seq_ptr(s), seq_ptr(s) + shape_.seq_floats());
        return cp;
    }
    /// Replaces sequence s's state and interval by a checkpoint taken from a memory of
    /// the same shape. Throws invalid_argument (a state of another size, an impossible
    /// interval, an empty checkpoint with a nonzero state) or transaction_open.
    void restore_checkpoint(seq_id_t s, const recurrent_checkpoint& cp) {
        check_no_tx("restore_checkpoint");
        check_seq("restore_checkpoint", "seq_id", s, false);
        if (cp.state.size() != shape_.seq_floats())
            detail::fail(errc::invalid_argument, "restore_checkpoint: the checkpoint holds " +
                                                     std::to_string(cp.state.size()) + " floats, this memory's "
                                                     "sequences hold " + std::to_string(shape_.seq_floats()));
        const bool empty = cp.pos_min == -1 && cp.pos_max == -1;
        if (!empty && !(cp.pos_min >= 0 && cp.pos_min <= cp.pos_max))
            detail::fail(errc::invalid_argument, "restore_checkpoint: interval [" + std::to_string(cp.pos_min) + ", " +
                                                     std::to_string(cp.pos_max) +
                                                     "], must be 0 <= pos_min <= pos_max or both -1 (empty)");
        if (empty && std::any_of(cp.state.begin(), cp.state.end(), [](float x) { return x != 0.0f; }))
            detail::fail(errc::invalid_argument, "restore_checkpoint: an empty checkpoint (interval -1) must hold a zero state");
        guard_seq(s);
        std::copy(cp.state.begin(), cp.state.end(), seq_ptr(s));
        pos_min_[static_cast<std::size_t>(s)] = cp.pos_min;
        pos_max_[static_cast<std::size_t>(s)] = cp.pos_max;
    }

    /// Sets sequence s's state and interval without checks beyond a debug assertion;
    /// for io/recurrent.hpp, which validated both. Never throws.
    void assign_seq(detail::internal_access, seq_id_t s, pos_t pos_min, pos_t pos_max, const float* state) noexcept {
        KVCACHE_ASSERT(s >= 0 && static_cast<std::uint32_t>(s) < shape_.n_seq_max && !in_tx_);
        std::copy(state, state + shape_.seq_floats(), seq_ptr(s));
        pos_min_[static_cast<std::size_t>(s)] = pos_min;
        pos_max_[static_cast<std::size_t>(s)] = pos_max;
    }
    /// Empties sequence s (state zeroed); for io/recurrent.hpp. Never throws.
    void empty_seq(detail::internal_access, seq_id_t s) noexcept { empty_seq(s); }

    /// Journal of a compound operation (slot_manager::prepare / release): the intervals;
    /// the states come back through the guard. From begin_guard on, the state of every
    /// sequence that held one is copied before an operation overwrites it (seq_rm,
    /// seq_keep, seq_cp's destination, seq_add / seq_div emptying it, restore_checkpoint,
    /// state loads through io), so that load_journal + rollback_guard put the memory back
    /// bit-identical. Costs one sequence state per sequence overwritten.
    struct journal_mark {
        std::vector<pos_t> pos_min, pos_max;
    };
    /// May throw std::bad_alloc (nothing changed).
    void save_journal(journal_mark& m, detail::internal_access) const {
        m.pos_min = pos_min_;
        m.pos_max = pos_max_;
    }
    /// Puts the intervals back (swaps; never throws). Call it with no transaction open.
    void load_journal(journal_mark& m, detail::internal_access) noexcept {
        pos_min_.swap(m.pos_min);
        pos_max_.swap(m.pos_max);
    }
    /// Starts the guard (may throw std::bad_alloc; nothing changed).
    void begin_guard(const journal_mark&, detail::internal_access) {
        guard_done_.assign(shape_.n_seq_max, 0);
        guard_ids_.clear();
        guard_data_.clear();
        guard_on_ = true;
    }
    /// Ends the guard keeping the memory as it is. Never throws.
    void end_guard(detail::internal_access) noexcept {
        guard_on_ = false;
        guard_ids_.clear();
        guard_data_.clear();
    }
    /// Writes the kept states back and ends the guard (after load_journal). Never throws.
    void rollback_guard(detail::internal_access) noexcept {
        const std::size_t n = shape_.seq_floats();
        for (std::size_t i = 0; i < guard_ids_.size(); ++i)
            std::copy(guard_data_.begin() + static_cast<std::ptrdiff_t>(i * n),
                      guard_data_.begin() + static_cast<std::ptrdiff_t>((i + 1) * n), seq_ptr(guard_ids_[i]));
        end_guard(detail::internal_access{});
    }
    /// Copies sequence s's state before a library component overwrites it (io loads);
    /// may throw std::bad_alloc before anything is written. s < 0: every sequence.
    void guard_seqs(detail::internal_access, seq_id_t s) {
        if (s >= 0) {
            guard_seq(s);
            return;
        }
        for (seq_id_t t = 0; static_cast<std::uint32_t>(t) < shape_.n_seq_max; ++t) guard_seq(t);
    }

    /// The intervals and transaction snapshots before a placement, so that a composite
    /// (hybrid_memory) can undo the placement when its other part refuses the batch.
    struct place_mark {
        std::vector<pos_t> pos_min, pos_max;
        std::size_t n_backups = 0;
        bool in_tx = false;
    };
    /// Saves the mark (may throw std::bad_alloc; nothing changed then).
    void save_mark(place_mark& m, detail::internal_access) const {
        m.pos_min = pos_min_;
        m.pos_max = pos_max_;
        m.n_backups = backups_.size();
        m.in_tx = in_tx_;
    }
    /// Undoes the placements made since `m` was saved (their states were not written yet).
    /// Never throws.
    void undo_place(const place_mark& m, detail::internal_access) noexcept {
        std::copy(m.pos_min.begin(), m.pos_min.end(), pos_min_.begin());
        std::copy(m.pos_max.begin(), m.pos_max.end(), pos_max_.begin());
        for (std::size_t i = m.n_backups; i < backups_.size(); ++i) touched_[static_cast<std::size_t>(backups_[i].seq)] = 0;
        backups_.resize(m.n_backups, backup{0, -1, -1});
        backup_data_.resize(m.n_backups * shape_.seq_floats());
        in_tx_ = m.in_tx;
    }

private:
    struct backup {
        seq_id_t seq;
        pos_t pos_min, pos_max;
    };
    struct range {
        std::int64_t lo, hi;  // [lo, hi)
    };
    enum class cover { none, part, all };

    static const recurrent_shape& validated(const recurrent_shape& s) {
        s.validate();
        return s;
    }
    float* seq_ptr(seq_id_t s) noexcept { return data_.data() + static_cast<std::size_t>(s) * shape_.seq_floats(); }
    const float* seq_ptr(seq_id_t s) const noexcept {
        return data_.data() + static_cast<std::size_t>(s) * shape_.seq_floats();
    }
    float* layer_ptr(const char* fn, std::uint32_t l, seq_id_t s) {
        check_layer_seq(fn, l, s);
        return seq_ptr(s) + std::size_t{l} * shape_.layer_floats();
    }
    const float* layer_ptr(const char* fn, std::uint32_t l, seq_id_t s) const {
        check_layer_seq(fn, l, s);
        return seq_ptr(s) + std::size_t{l} * shape_.layer_floats();
    }
    void check_layer_seq(const char* fn, std::uint32_t l, seq_id_t s) const {
        if (l >= shape_.n_layer)
            detail::fail(errc::invalid_argument, std::string(fn) + ": layer = " + std::to_string(l) +
                                                     ", must be < n_layer = " + std::to_string(shape_.n_layer));
        check_seq(fn, "seq_id", s, false);
    }
    void check_seq(const char* fn, const std::string& name, seq_id_t s, bool allow_all) const {
        if (allow_all && s < 0) return;
        if (s < 0 || static_cast<std::uint32_t>(s) >= shape_.n_seq_max)
            detail::fail(errc::invalid_argument, std::string(fn) + ": " + name + " = " + std::to_string(s) +
                                                     (allow_all ? ", must be < 0 (all) or in [0, " : ", must be in [0, ") +
                                                     std::to_string(shape_.n_seq_max) + ")");
    }
    void check_no_tx(const char* fn) const {
        if (in_tx_)
            detail::fail(errc::transaction_open,
                         std::string(fn) + ": placements are staged; commit() or restore() first");
    }
    static range make_range(const char* fn, pos_t p0, pos_t p1) {
        const std::int64_t lo = p0 < 0 ? 0 : p0;
        const std::int64_t hi = p1 < 0 ? std::int64_t{std::numeric_limits<pos_t>::max()} + 1 : p1;
        if (lo > hi)
            detail::fail(errc::invalid_argument, std::string(fn) + ": reversed range [p0, p1) = [" +
                                                     std::to_string(p0) + ", " + std::to_string(p1) + ")");
        return {lo, hi};
    }
    std::vector<seq_id_t> targets(seq_id_t s) const {
        std::vector<seq_id_t> t;
        if (s >= 0)
            t.push_back(s);
        else
            for (seq_id_t x = 0; static_cast<std::uint32_t>(x) < shape_.n_seq_max; ++x) t.push_back(x);
        return t;
    }
    /// How [lo, hi) meets sequence t's interval.
    cover overlap(seq_id_t t, range r) const noexcept {
        const std::int64_t mn = pos_min_[static_cast<std::size_t>(t)], mx = pos_max_[static_cast<std::size_t>(t)];
        if (mx < 0 || r.hi <= mn || r.lo > mx) return cover::none;
        return r.lo <= mn && r.hi > mx ? cover::all : cover::part;
    }
    result<void> refused_by_history(const char* fn, seq_id_t t, range r, const char* verb) const {
        return detail::make_error(
            errc::unsupported,
            std::string(fn) + ": refused by history: cannot " + verb + " positions [" + std::to_string(r.lo) + ", " +
                std::to_string(r.hi) + ") of sequence " + std::to_string(t) + ", which holds [" +
                std::to_string(pos_min_[static_cast<std::size_t>(t)]) + ", " +
                std::to_string(pos_max_[static_cast<std::size_t>(t)]) +
                "]: a recurrent state summarises all of them and cannot be rolled back (use the whole interval, "
                "or restore_checkpoint a state taken at the position you need)");
    }
    template <class F>
    result<void> move(const char* fn, seq_id_t s, range r, F f) {
        const std::vector<seq_id_t> ts = targets(s);
        for (seq_id_t t : ts) {
            const cover c = overlap(t, r);
            if (c == cover::none) continue;
            const auto u = static_cast<std::size_t>(t);
            if (c == cover::part) return refused_by_history(fn, t, r, "move only");
            const std::int64_t mn = f(pos_min_[u]), mx = f(pos_max_[u]);
            if (mx > std::numeric_limits<pos_t>::max())
                detail::fail(errc::invalid_argument, std::string(fn) + ": position " + std::to_string(pos_max_[u]) +
                                                         " of sequence " + std::to_string(t) + " would move to " +
                                                         std::to_string(mx) + ", beyond the largest position 2^31-1");
            if (mn < 0 && mx >= 0)
                return detail::make_error(
                    errc::unsupported, std::string(fn) + ": refused by history: sequence " + std::to_string(t) +
                                           " would move from [" + std::to_string(pos_min_[u]) + ", " +
                                           std::to_string(pos_max_[u]) + "] to [" + std::to_string(mn) + ", " +
                                           std::to_string(mx) +
                                           "]: its positions below 0 would be dropped, but its state cannot forget them");
        }
        for (seq_id_t t : ts)
            if (overlap(t, r) == cover::all && f(pos_max_[static_cast<std::size_t>(t)]) < 0) guard_seq(t);
        for (seq_id_t t : ts) {
            if (overlap(t, r) != cover::all) continue;
            const auto u = static_cast<std::size_t>(t);
            const std::int64_t mn = f(pos_min_[u]), mx = f(pos_max_[u]);
            if (mx < 0) {
                empty_seq(t);
            } else {
                pos_min_[u] = static_cast<pos_t>(mn);
                pos_max_[u] = static_cast<pos_t>(mx);
            }
        }
        return {};
    }
    /// The guard's copy of sequence t's state, once (begin_guard); may throw std::bad_alloc.
    void guard_seq(seq_id_t t) {
        const auto u = static_cast<std::size_t>(t);
        if (!guard_on_ || guard_done_[u] != 0) return;
        const std::size_t n = shape_.seq_floats();
        guard_ids_.reserve(guard_ids_.size() + 1);
        guard_data_.insert(guard_data_.end(), seq_ptr(t), seq_ptr(t) + n);  // strong: nothing added on a throw
        guard_ids_.push_back(t);
        guard_done_[u] = 1;
    }
    void empty_seq(seq_id_t t) noexcept {
        const auto u = static_cast<std::size_t>(t);
        std::fill(seq_ptr(t), seq_ptr(t) + shape_.seq_floats(), 0.0f);
        pos_min_[u] = pos_max_[u] = -1;
    }
    void drop_backups() noexcept {
        for (const backup& b : backups_) touched_[static_cast<std::size_t>(b.seq)] = 0;
        backups_.clear();
        backup_data_.clear();
        in_tx_ = false;
    }

    recurrent_shape shape_;
    std::vector<float> data_;          // n_seq_max x n_layer x (conv, ssm)
    std::vector<pos_t> pos_min_;       // per sequence, -1: empty
    std::vector<pos_t> pos_max_;       // per sequence, -1: empty
    std::vector<unsigned char> touched_;  // per sequence: snapshotted by the open transaction
    std::vector<backup> backups_;      // one per touched sequence, in snapshot order
    std::vector<float> backup_data_;   // their states, seq_floats() each
    bool in_tx_ = false;
    bool guard_on_ = false;                 // begin_guard .. end_guard / rollback_guard
    std::vector<unsigned char> guard_done_;  // per sequence: its state copied by the guard
    std::vector<seq_id_t> guard_ids_;        // copied sequences, in order
    std::vector<float> guard_data_;          // their states, seq_floats() each
};

static_assert(memory<recurrent_memory>, "kvcache: recurrent_memory must satisfy kvcache::memory");

namespace reuse {
/// reuse::apply_plan on a recurrent_memory: keeps positions [0, n_past) of seq, which only
/// works when that is all of them or none (n_past 0 clears it): otherwise refused with
/// errc::unsupported (refused by history), nothing changed. slot_manager first resumes
/// from a checkpoint at n_past. Throws invalid_argument (bad seq, a plan with chunk moves:
/// chunk reuse is off for recurrent states) or transaction_open.
[[nodiscard]] inline result<void> apply_plan(recurrent_memory& mem, seq_id_t seq, const plan& p) {
    check_apply_args(seq, mem.n_seq_max(), mem.in_transaction(), p);
    if (!p.moves.empty())
        detail::fail(errc::invalid_argument, "apply_plan: the plan moves chunks, but chunk reuse is off for recurrent "
                                             "states (their tokens cannot be reordered)");
    return mem.seq_rm(seq, static_cast<pos_t>(p.n_past), -1);
}
}  // namespace reuse

KVCACHE_END_NAMESPACE
