// kvcache: slots, the host's entry point to prefix reuse across requests
// (F19-F23). A slot owns one sequence of the cache and the tokens it holds.
//
//   kvcache::slot_manager slots(cache, {.n_slots = 2});
//   auto p = slots.prepare(request, {.salt = tenant}).value();  // picks a slot, reuses what it can
//   // (an error result: no_space when every slot is busy; check p.ok() to wait instead)
//   // (chunks moved by chunk_shift were already rotated: slot_options::apply_k_shift)
//   // compute request positions [p.n_past, p.n_request) into sequence p.seq
//   slots.commit_prompt(p.slot);
//   // per generated token placed at position slots.tokens(p.slot).size():
//   slots.append(p.slot, token);
//   slots.release(p.slot);                             // idle; saved to the global cache
//
// What is reused is decided by the cache's reuse policy (Cache::reuse, concept
// kvcache::reuse_policy): reuse::none (nothing), reuse::lcp, reuse::chunk_shift<N>,
// reuse::global<Base, Eviction> or a custom one. prepare() asks the policy for a plan,
// checks it (reuse::check_plan) and executes exactly that plan (reuse::apply_plan).
//
// Entry validation: an idle slot's state records the generation of its sequence
// (Cache::seq_generation, else the sequence's extent: detail::seq_fingerprint) when it
// last changed it; prepare() drops every idle slot state and global entry whose cells
// the host changed since (seq_rm, seq_keep, clear, ...), counts it
// (slot_states_invalidated, prompt-cache `invalidated`, miss reason `invalidated`) and
// never serves it.
//
// Room: idle slots keep their sequences' cells (and shared_store entries share them). When
// the positions a prepared request leaves to compute do not fit (free blocks on a paged
// layout, free cells otherwise), prepare() evicts unpinned shared_store entries (eviction
// order), then idle slot states (least recently used first; never a busy slot, never the
// slot it prepares) until they fit, complete or nothing: if evicting all of them would
// not make room, nothing is evicted and the host's placement meets no_space. Counted:
// prompt-cache `evictions`, slot_states_evicted, room_refused.
//
// Storage tiers (attach_tiers, tier/tier_cache.hpp: memory -> disk -> Redis under the
// global prompt cache): release() publishes the slot's tokens after the global save;
// prepare() asks the tiers for a longer prefix than the plan kept (loaded into a reserved
// scratch sequence, then shared with the slot's), before room is made. Another process or
// a restarted one sharing the tiers (a disk directory, a Redis server) so starts from the
// K/V this one computed (request_metrics::from_tier, prefix-cache hits source="tier").
// One scrape text with both counter sets: to_prometheus_all().
//
// Allocation failure (std::bad_alloc; tests/fault_injection/fault_injection_prompt.cpp):
// commit_prompt, append, save_checkpoint and clear_slot complete or change nothing;
// release too (the uncommitted positions it removes are put back from a cache
// checkpoint, the global save is strong; a slot state it drops because the host changed
// the slot's cells comes back through the journal below). prepare is strong too, on
// every memory: any exception leaves the cache (metadata, indexes, block tables, the
// K/V of every occupied cell, recurrent states), the slots, the store and the global
// prompt cache as they were, through an undo journal (see "prepare's journal" below; it
// costs a journal of the cell table's changes, a pass over the cells' occupancy and a copy
// of the layout's tables per call: slot_options::strong_prepare = false turns it off). The storage tiers may keep a promotion the fetch queued (a copy of a blob they
// hold) and count the fetch. With a custom store whose release() may throw and that
// keeps no undo record, and with strong_prepare off, prepare is a sequence of steps each
// complete or nothing: when one throws, nothing is ever served wrong: the cache stays
// consistent, no slot is left busy, every idle slot's tokens are what its sequence holds
// (the slot being prepared forgets its tokens, so the next prepare recomputes) and every
// global entry is intact (a load that threw left it in the cache).
//
// Recurrent and hybrid memories (recurrent_memory, hybrid_memory<A>): a recurrent state
// cannot be rolled back, so a prefix shorter than what the slot (or entry) holds is served
// from a checkpoint: the sequence's whole state (state_store: io::save_seq bytes of both
// parts) saved by save_checkpoint while the host computes a prompt. prepare() lists where
// the host should save them (prepared_request::checkpoints: every checkpoint_every
// positions, checkpoint_tail positions before the prompt end, and at request_options::
// checkpoint_at boundaries such as user-message starts, like llama-server's
// --ctx-checkpoints); a slot keeps at most max_checkpoints of them and
// max_checkpoint_bytes (oldest dropped first, counted: checkpoints_dropped), and they are
// saved with the slot's global prompt-cache entry. prepare() resumes from the newest
// checkpoint at or below the common prefix, else recomputes from 0; either way a lost
// prefix is reported (miss reason no_checkpoint, request_metrics::checkpoint_restored),
// never silently. Chunk reuse (F20) is off: a recurrent state summarises its tokens in order.
// Over an ISWA attention part (hybrid_memory<iswa_cache<...>>) a checkpoint holds the
// sliding-window layers too. A checkpoint's bytes grow with its position (the attention
// part's K/V up to it): bound them with max_checkpoint_bytes.
//
// Thread safety: not thread-safe. A slot_manager, its prompt cache and the cache it works
// on are one unit: call them from one thread at a time (one mutex around every call, const
// calls included). The host's own computation between prepare and commit_prompt may run
// on any threads, as long as no slot_manager call runs meanwhile.
#pragma once

#include <algorithm>    // std::max
#include <concepts>     // std::convertible_to
#include <cstddef>      // std::size_t
#include <cstdint>      // fixed-width integers
#include <new>          // std::bad_alloc
#include <optional>     // global cache
#include <span>         // Prometheus labels
#include <string>       // messages
#include <type_traits>  // std::is_copy_constructible_v
#include <utility>      // std::move
#include <variant>      // std::monostate
#include <vector>       // slots

#include "../error.hpp"
#include "../layout/capabilities.hpp"
#include "../ops/hybrid.hpp"
#include "../ops/kshift.hpp"
#include "../concepts.hpp"
#include "../reuse/global.hpp"
#include "../reuse/plan.hpp"
#include "../io/hybrid.hpp"
#include "../io/recurrent.hpp"
#include "../memory/hybrid.hpp"
#include "../memory/iswa_cache.hpp"
#include "../memory/recurrent.hpp"
#include "../memory/memory.hpp"
#include "entry_store.hpp"
#include "prompt_cache.hpp"
#include "state_store.hpp"
#include "../tier/tier_cache.hpp"
#include "../tokens/prompt_tokens.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Configuration of a slot_manager.
struct slot_options {
    std::uint32_t n_slots = 1;        ///< number of slots (>= 1)
    seq_id_t first_seq = 0;           ///< slot i uses sequence first_seq + i
    double similarity = 0.1;          ///< F22: minimum lcp / request length to prefer a slot by prefix
    /// F23: sliding window of the cache (0: full attention, no checkpoints). On a memory with
    /// a window of its own (iswa_cache, kv_cache<ring<W>>) 0 means that window, and any other
    /// value than it is refused.
    std::uint32_t n_swa = 0;
    std::uint32_t max_checkpoints = 8;  ///< F23: checkpoints kept per slot (oldest dropped)
    /// Bytes of checkpoints kept per slot (store bytes; 0: no limit). Oldest dropped first;
    /// the newest checkpoint is always kept.
    std::size_t max_checkpoint_bytes = 0;
    /// Checkpoint schedule (prepared_request::checkpoints; sliding-window and recurrent
    /// memories only): every checkpoint_every prompt positions (0: none) ...
    std::uint32_t checkpoint_every = 0;
    /// ... and checkpoint_tail positions before the prompt end (0: none; 1 lets an exact
    /// repeat of the prompt resume one token before its end).
    std::uint32_t checkpoint_tail = 1;
    prompt_cache_limits cache_limits{};  ///< F21: limits of the global prompt cache (reuse::global only)
    bool apply_k_shift = true;        ///< F20: rotate moved K in prepare (else the host calls ops::apply_k_shift)
    int n_threads = 0;                ///< threads of that K-shift (<= 0: OpenMP default)
    /// prepare() with the strong guarantee (an undo journal, see "Allocation failure" in
    /// the file comment; on a K/V cache it journals the cell table's changes and reads its
    /// occupancy once per call).
    /// false: compound (each step complete or nothing, nothing ever served wrong).
    bool strong_prepare = true;
};

/// Per-request options.
struct request_options {
    bool cache_prompt = true;  ///< false: recompute the whole prompt (nothing reused)
    int slot_id = -1;          ///< >= 0: use this slot (it must be idle)
    std::uint64_t salt = 0;    ///< tenant namespace: state is never reused across salts
    std::int32_t priority = 0;  ///< priority of the entry saved on release (reuse::evict_priority)
    bool pin = false;          ///< the entry saved on release is never evicted
    /// Extra checkpoint boundaries (prefix lengths, e.g. where each user message starts) for
    /// prepared_request::checkpoints (sliding-window and recurrent memories only).
    std::vector<std::uint32_t> checkpoint_at{};
};

/// Options of slot_manager::attach_tiers (the storage tiers under the slots and the global
/// prompt cache: tier/tier_cache.hpp).
struct tier_hook_options {
    /// A sequence id the slots and the entry store never use, reserved for tier loads
    /// (required; attach_tiers refuses one that collides or is out of range).
    seq_id_t scratch_seq = -1;
    bool publish_on_release = true;  ///< release() offers the slot's tokens to the tiers (after the global save)
    bool fetch_on_prepare = true;    ///< prepare() asks the tiers for a longer prefix than it kept
    /// Promotion of a lower-tier hit found by prepare(): deferred (default) keeps the copy
    /// into the upper tiers off the request's time to first token; release() runs the
    /// queued promotions (tier_cache::promote_pending) before it publishes.
    tier::promotion promote = tier::promotion::deferred;
};

/// Where a request's tokens came from (vLLM's meaning: query_tokens = n_request, hit_tokens
/// = tokens reused = from_slot + from_global + from_shift + from_tier = n_past; computed =
/// the rest).
struct request_metrics {
    std::uint32_t n_request = 0;    ///< request positions (the request's query_tokens)
    std::uint32_t from_slot = 0;    ///< exact prefix kept from the slot's own state
    std::uint32_t from_global = 0;  ///< exact prefix kept from a global prompt cache entry
    std::uint32_t from_shift = 0;   ///< approximate: moved into place by chunk shifting
    /// Exact prefix loaded from a storage tier beyond what the slot or entry gave
    /// (slot_manager::attach_tiers); from_slot / from_global keep what they gave.
    std::uint32_t from_tier = 0;
    int tier = -1;                  ///< index of the tier in the chain that served from_tier (-1: none)
    std::uint32_t computed = 0;     ///< the host must compute these
    bool checkpoint_restored = false;  ///< a checkpoint (SWA, F23, or recurrent state) was loaded
    miss_reason miss = miss_reason::none;  ///< why less was reused than could have been (none: nothing lost)
    /// Tokens reused (not computed).
    [[nodiscard]] std::uint32_t hit_tokens() const noexcept { return from_slot + from_global + from_shift + from_tier; }
};

/// The answer of slot_manager::prepare.
struct prepared_request {
    int slot = -1;             ///< slot serving the request
    seq_id_t seq = -1;         ///< the slot's sequence
    std::uint32_t n_past = 0;  ///< request positions [0, n_past) are in the cache at positions [0, n_past)
    std::uint32_t n_request = 0;  ///< compute request positions [n_past, n_request)
    reuse::plan plan;          ///< the reuse plan that was applied
    bool k_shift_pending = false;  ///< chunks moved: rotate K (ops::apply_k_shift) before attention
    /// Prefix lengths b in (n_past, n_request), increasing, after which the host should call
    /// save_checkpoint(slot) (having computed exactly positions [0, b)); empty unless the
    /// memory needs checkpoints (a sliding window, recurrent layers). See slot_options.
    std::vector<std::uint32_t> checkpoints;
    request_metrics metrics;
};

/// The entry store slots use unless told otherwise: copy_store (K/V copied to host memory)
/// for one K/V cache, state_store (io state bytes, validated on load) for a composite
/// memory such as iswa_cache.
template <class Cache>
using default_entry_store =
    std::conditional_t<composite_memory<Cache> || !kv_memory<Cache>, state_store<Cache>, copy_store<Cache>>;

/// Slots over one memory (kv_cache, or iswa_cache, whose sliding-window part takes its
/// SWA checkpoints from iswa_cache::window), with the reuse policy of Cache and, for
/// reuse::global, a global prompt cache whose entries are kept by Store (copy_store,
/// state_store or shared_store).
/// Thread safety: not thread-safe; one thread at a time for the manager and its cache
/// (see the file comment).
template <class Cache, class Store = default_entry_store<Cache>>
class slot_manager {
    static_assert(memory<Cache>, "kvcache: slot_manager<Cache> needs a kvcache::memory (see kvcache/memory/memory.hpp)");

    using policy = typename Cache::reuse;
    static_assert(reuse_policy<policy>,
                  "kvcache: the cache's reuse policy does not satisfy kvcache::reuse_policy (see kvcache/concepts.hpp)");
    static constexpr bool uses_global = policy::global_cache;
    using eviction = typename reuse::eviction_of<policy>::type;

public:
    using reuse_policy_type = policy;
    using cache_type = prompt_cache<Cache, Store, eviction>;
    using checkpoint = typename cache_type::checkpoint;

    /// Throws kvcache::error(invalid_argument) naming a bad option (slots beyond n_seq_max,
    /// n_swa other than an ISWA cache's window, ...). On an ISWA cache n_swa = 0 means its window.
    slot_manager(Cache& cache, slot_options opt, Store store = Store{}) : cache_(&cache), opt_(opt) {
        using std::to_string;
        if (opt.n_slots == 0) detail::fail(errc::invalid_argument, "slot_manager: n_slots = 0, must be >= 1");
        if (opt.first_seq < 0 || std::uint64_t(opt.first_seq) + opt.n_slots > cache.n_seq_max())
            detail::fail(errc::invalid_argument, "slot_manager: sequences [" + to_string(opt.first_seq) + ", " +
                                                     to_string(std::int64_t{opt.first_seq} + opt.n_slots) +
                                                     ") do not fit n_seq_max = " + to_string(cache.n_seq_max()));
        if constexpr (requires { Cache::window; cache.window_pos_min(seq_id_t{0}); }) {  // ISWA: checkpoints from its window
            if (opt_.n_swa == 0) opt_.n_swa = Cache::window;
            if (opt_.n_swa != Cache::window)
                detail::fail(errc::invalid_argument, "slot_manager: n_swa = " + to_string(opt.n_swa) +
                                                         ", the ISWA cache's window is " + to_string(Cache::window));
        } else if constexpr (requires { typename Cache::storage_t; }) {
            if constexpr (has_capability<typename Cache::storage_t, layout_caps::sliding_window>) {  // ring<W>
                const std::uint32_t w = cache.storage().window();
                if (opt_.n_swa == 0) opt_.n_swa = w;  // a ring forgets positions: slots must know its window
                if (opt_.n_swa != w)
                    detail::fail(errc::invalid_argument, "slot_manager: n_swa = " + to_string(opt.n_swa) +
                                                             ", the ring layout's window is " + to_string(w));
            }
        }
        if (!(opt.similarity >= 0.0 && opt.similarity <= 1.0))
            detail::fail(errc::invalid_argument,
                         "slot_manager: similarity = " + std::to_string(opt.similarity) + ", must be in [0, 1]");
        slots_.resize(opt.n_slots);
        if constexpr (uses_global)
            global_.emplace(opt.cache_limits, std::move(store));
        else
            own_store_ = std::move(store);
    }
    slot_manager(const slot_manager&) = delete;
    slot_manager& operator=(const slot_manager&) = delete;

    [[nodiscard]] std::uint32_t n_slots() const noexcept { return static_cast<std::uint32_t>(slots_.size()); }
    [[nodiscard]] seq_id_t seq_of(int slot) const { return opt_.first_seq + check_slot("seq_of", slot); }
    /// Tokens the slot's sequence holds.
    [[nodiscard]] const prompt_tokens& tokens(int slot) const { return slots_[check_slot("tokens", slot)].tokens; }
    [[nodiscard]] bool busy(int slot) const { return slots_[check_slot("busy", slot)].busy; }
    [[nodiscard]] std::size_t n_checkpoints(int slot) const { return slots_[check_slot("n_checkpoints", slot)].checkpoints.size(); }
    /// The positions [pos_min, pos_max] each of the slot's checkpoints holds, oldest first.
    [[nodiscard]] std::vector<std::pair<pos_t, pos_t>> checkpoint_spans(int slot) const {
        std::vector<std::pair<pos_t, pos_t>> out;
        for (const checkpoint& ck : slots_[check_slot("checkpoint_spans", slot)].checkpoints) out.emplace_back(ck.pos_min, ck.pos_max);
        return out;
    }
    /// Store bytes of the slot's checkpoints (bounded by slot_options::max_checkpoint_bytes).
    [[nodiscard]] std::size_t checkpoint_bytes(int slot) {
        std::size_t n = 0;
        for (const auto& ck : slots_[check_slot("checkpoint_bytes", slot)].checkpoints) n += store().bytes(*cache_, ck.state);
        return n;
    }
    /// Whether the cache holds recurrent states (recurrent_memory, hybrid_memory): prefix
    /// reuse below what a slot holds needs a checkpoint.
    static constexpr bool has_recurrent_state =
        std::same_as<Cache, recurrent_memory> || requires(const Cache& c) { c.recurrent(); };
    /// Whether the reuse policy keeps a global prompt cache.
    static constexpr bool has_global_cache = uses_global;
    /// The reuse policy object whose plan() decides what prepare() reuses (default constructed).
    [[nodiscard]] policy& reuse_policy_object() noexcept { return policy_; }
    [[nodiscard]] const policy& reuse_policy_object() const noexcept { return policy_; }
    /// The global prompt cache (reuse::global only).
    [[nodiscard]] cache_type& global_cache() requires uses_global { return *global_; }
    /// Cumulative counters: requests and tokens (query_tokens, hit_tokens by source, miss
    /// reasons) of every prepare, and the global prompt cache's entry counters (zero without
    /// a global cache). Render them with to_prometheus().
    [[nodiscard]] prefix_cache_metrics metrics() const {
        prefix_cache_metrics m;
        if constexpr (uses_global) m = global_->metrics();
        m.requests = counters_.requests;
        m.query_tokens = counters_.query_tokens;
        m.hit_tokens = counters_.hit_tokens;
        m.hit_tokens_slot = counters_.hit_tokens_slot;
        m.hit_tokens_global = counters_.hit_tokens_global;
        m.hit_tokens_shifted = counters_.hit_tokens_shifted;
        m.hit_tokens_tier = counters_.hit_tokens_tier;
        m.tier_fetch_errors = counters_.tier_fetch_errors;
        m.tier_publish_errors = counters_.tier_publish_errors;
        for (std::size_t r = 0; r < n_miss_reasons; ++r) m.misses[r] = counters_.misses[r];
        m.slot_states_invalidated = counters_.slot_states_invalidated;
        m.slot_states_evicted = counters_.slot_states_evicted;
        m.room_refused = counters_.room_refused;
        m.checkpoints_saved = counters_.checkpoints_saved;
        m.checkpoints_dropped = counters_.checkpoints_dropped;
        m.checkpoints_restored = counters_.checkpoints_restored;
        return m;
    }

    /// Attaches a chain of storage tiers, a tier::tier_cache<Cache, Tiers...> (it must
    /// outlive the manager or be detached; one chain at a time, a second attach replaces
    /// the first). From then on, for requests with cache_prompt:
    ///  - prepare(), once the reuse plan is executed (slot prefix, global entry, chunk
    ///    shift, checkpoint) and before room is made, asks the tiers for a longer prefix
    ///    when fewer than n_request - 1 positions are kept (tier_cache::fetch into
    ///    o.scratch_seq, capped at n_request - 1 so the last position is computed, salt =
    ///    request_options::salt). A longer hit replaces the sequence (request_metrics::
    ///    from_tier, tier; a replaced chunk-shift plan reports from_shift = 0 and the
    ///    prepared plan becomes a plain prefix of n_past); a shorter one is not taken. A
    ///    fetch that fails (a refused blob, counted by the tier chain) or throws
    ///    std::bad_alloc (counted: tier_fetch_errors) leaves the slot as the plan left it.
    ///    A longer blob that found no free cells (tier::fetch_info::no_room) is fetched once
    ///    more after idle slot states and global entries were evicted for it (make_room).
    ///    A lower-tier hit is promoted as o.promote says (deferred by default: queued).
    ///  - release(), after the global save, runs the queued promotions
    ///    (tier_cache::promote_pending), then publishes the slot's tokens to the tiers
    ///    (tier_cache::publish, the slot's salt). Either throwing is counted
    ///    (tier_publish_errors) and the release completes.
    /// Memories with recurrent state (recurrent_memory, hybrid_memory) take only tier blobs
    /// whose whole length fits the request (tier_cache::can_cut). Without a global prompt
    /// cache (reuse::lcp, reuse::none) the tiers are the only cache shared by the slots.
    /// Throws invalid_argument when o.scratch_seq is outside [0, n_seq_max), is a slot's
    /// sequence, is reserved by the entry store (shared_store) or holds positions now.
    template <class TierCache>
    void attach_tiers(TierCache& tiers, tier_hook_options o) {
        static_assert(requires { typename TierCache::memory_type; } &&
                          std::same_as<typename TierCache::memory_type, Cache>,
                      "kvcache: slot_manager<Cache>::attach_tiers needs a tier::tier_cache<Cache, ...> of the same Cache");
        using std::to_string;
        const seq_id_t sc = o.scratch_seq;
        if (sc < 0 || std::uint64_t(sc) >= cache_->n_seq_max())
            detail::fail(errc::invalid_argument, "slot_manager::attach_tiers: scratch_seq = " + to_string(sc) +
                                                     ", must be in [0, n_seq_max = " + to_string(cache_->n_seq_max()) + ")");
        if (sc >= opt_.first_seq && std::int64_t{sc} < std::int64_t{opt_.first_seq} + n_slots())
            detail::fail(errc::invalid_argument, "slot_manager::attach_tiers: scratch_seq = " + to_string(sc) +
                                                     " is the sequence of slot " + to_string(sc - opt_.first_seq));
        if constexpr (requires(const Store& st) { st.reserves(sc); })
            if (store().reserves(sc))
                detail::fail(errc::invalid_argument, "slot_manager::attach_tiers: scratch_seq = " + to_string(sc) +
                                                         " is reserved by the entry store (shared_store)");
        if (cache_->seq_pos_max(sc) >= 0)
            detail::fail(errc::invalid_argument, "slot_manager::attach_tiers: scratch_seq = " + to_string(sc) +
                                                     " holds positions (the host or an entry uses it)");
        tiers_.obj = &tiers;
        tiers_.opt = o;
        tiers_.fetch = [](void* t, Cache& c, seq_id_t dst, const prompt_tokens& req, std::uint64_t salt,
                          std::size_t max_tokens, tier::promotion promote) {
            return static_cast<TierCache*>(t)->fetch(c, dst, req, salt, max_tokens, promote);
        };
        tiers_.promote_pending = [](void* t) { static_cast<void>(static_cast<TierCache*>(t)->promote_pending()); };
        tiers_.publish = [](void* t, const Cache& c, seq_id_t seq, const prompt_tokens& tok, std::uint64_t salt) {
            static_cast<void>(static_cast<TierCache*>(t)->publish(c, seq, tok, salt));
        };
        tiers_.metrics = [](void* t) { return static_cast<TierCache*>(t)->metrics(); };
    }
    /// Detaches the tier chain (prepare and release no longer call it).
    void detach_tiers() noexcept { tiers_ = tier_hook{}; }
    /// Whether a tier chain is attached.
    [[nodiscard]] bool has_tiers() const noexcept { return tiers_.obj != nullptr; }

    /// The one text a host scrapes: to_prometheus(metrics(), prefix, labels) followed, when
    /// tiers are attached, by tier::to_prometheus of the tier chain's metrics (same prefix
    /// and labels; its names are <prefix>_tier_*, none shared with the prefix-cache ones).
    /// Throws invalid_argument for an invalid prefix or label name, and, with tiers, for a
    /// label value that would need escaping (backslash, quote, newline).
    [[nodiscard]] std::string to_prometheus_all(std::string_view prefix = "kvcache",
                                                std::span<const metric_label> labels = {}) const {
        std::string out = kvcache::to_prometheus(metrics(), prefix, labels);
        if (tiers_.obj != nullptr) {
            std::vector<std::pair<std::string, std::string>> l;
            for (const metric_label& x : labels) l.emplace_back(x.name, x.value);
            out += tier::to_prometheus(tiers_.metrics(tiers_.obj), prefix, l);
        }
        return out;
    }

    /// Picks a slot for `request` and makes its sequence hold the longest reusable prefix:
    /// global cache entry or slot state (F21), LCP (F19), chunk shift (F20), SWA checkpoint
    /// (F23). The host then computes request positions [n_past, n_request) into sequence
    /// `seq` and calls commit_prompt(slot). What is kept is the reuse policy's plan, executed
    /// as planned (with n_swa > 0 it may be cut back to an SWA checkpoint, F23); requests with
    /// cache_prompt = false do not ask the policy and keep nothing. First, idle slot states
    /// and global entries whose cells the host changed are dropped (see the file comment).
    /// Throws kvcache::error:
    /// invalid_argument (empty request, bad or busy slot_id, or a plan that check_plan refuses:
    /// it claims more than the tokens allow, or moves cells while the policy's needs_shift is
    /// false; thrown before the cache or the slots change), transaction_open. Returns an error
    /// result, nothing changed, when every slot is busy (no_space). When the selected global
    /// entry cannot be loaded (no room, invalidated) the slot keeps its own state and reuses
    /// from it (miss reason load_failed or invalidated, no hit counted; the policy is then
    /// asked a second time, and a plan check_plan refuses throws with the slot's own state
    /// back in place). When the cache cannot
    /// take the plan (reuse::apply_plan refuses: no free cell to split shared cells, positions a
    /// ring pruned) the slot's state is dropped and the whole request is computed (n_past 0).
    /// Last, room is made for the positions left to compute by evicting shared_store entries
    /// and idle slot states, complete or nothing (see "Room" in the file comment).
    /// The K-shift (apply_k_shift) runs last, after every other step that can throw.
    /// Strong: when anything throws (std::bad_alloc, a refused plan) everything is as
    /// before the call, the K/V of occupied cells and recurrent states included (with
    /// slot_options::strong_prepare off, or a store whose release may throw, compound:
    /// each step is complete or nothing and nothing is ever served wrong; file comment).
    [[nodiscard]] result<prepared_request> prepare(const prompt_tokens& request, const request_options& ro = {}) {
        using std::to_string;
        if (request.empty()) detail::fail(errc::invalid_argument, "slot_manager::prepare: the request has no tokens");
        if (cache_->in_transaction())
            detail::fail(errc::transaction_open, "slot_manager::prepare: placements are staged; commit() or restore() first");
        const bool reuse_on = ro.cache_prompt;
        if (ro.slot_id >= 0 && slots_[check_slot("prepare", ro.slot_id)].busy)
            detail::fail(errc::invalid_argument, "slot_manager::prepare: slot_id = " + std::to_string(ro.slot_id) + " is busy");
        if (reuse_on && tiers_.obj != nullptr && tiers_.opt.fetch_on_prepare && cache_->seq_pos_max(tiers_.opt.scratch_seq) >= 0)
            detail::fail(errc::invalid_argument, "slot_manager::prepare: the tier scratch sequence " +
                                                     std::to_string(tiers_.opt.scratch_seq) +
                                                     " holds positions; it is reserved for tier loads");
        if (!opt_.strong_prepare) return prepare_steps(request, ro, reuse_on);
        return journaled(true, [&] { return prepare_steps(request, ro, reuse_on); });
    }

private:
    /// prepare() once the arguments are checked (under the journal where there is one).
    [[nodiscard]] result<prepared_request> prepare_steps(const prompt_tokens& request, const request_options& ro,
                                                         bool reuse_on) {
        // Entries that cannot lie: idle states whose cells changed under them are dropped.
        std::size_t lost_invalid = 0;  // longest prefix of the request such a state held
        for (std::size_t i = 0; i < slots_.size(); ++i) {
            slot& t = slots_[i];
            const seq_id_t ts = opt_.first_seq + static_cast<seq_id_t>(i);
            if (t.busy || t.generation == detail::seq_fingerprint(*cache_, ts)) continue;
            if (!t.tokens.empty()) {
                ++counters_.slot_states_invalidated;
                if (t.salt == ro.salt) lost_invalid = std::max(lost_invalid, t.tokens.common_prefix(request));
            }
            drop_state(t, ts);
        }
        const int id = pick_slot(request, ro, reuse_on);
        if (id < 0)
            return detail::make_error(errc::no_space, "slot_manager::prepare: every one of the " +
                                                          std::to_string(slots_.size()) + " slots is busy");
        slot& s = slots_[static_cast<std::size_t>(id)];
        if (j_ != nullptr) {
            return prepare_slot(request, ro, reuse_on, lost_invalid, id);  // the journal undoes a throw
        } else {
            // Without a journal the slot's sequence changes step by step (each step complete
            // or nothing): if an allocation fails (std::bad_alloc) in one, the slot forgets
            // its tokens, so that what its sequence holds then is never served; the next
            // prepare recomputes. (A refused plan throws kvcache::error with the slot's state
            // in place.)
            try {
                return prepare_slot(request, ro, reuse_on, lost_invalid, id);
            } catch (const std::bad_alloc&) {
                s.tokens.clear();
                throw;
            }
        }
    }

    /// prepare() once the slot is chosen (see there).
    [[nodiscard]] result<prepared_request> prepare_slot(const prompt_tokens& request, const request_options& ro,
                                                        bool reuse_on, std::size_t lost_invalid, int id) {
        using std::to_string;
        slot& s = slots_[static_cast<std::size_t>(id)];
        const seq_id_t seq = opt_.first_seq + id;
        touch(static_cast<std::size_t>(id));
        prepared_request out;
        out.slot = id;
        out.seq = seq;
        out.n_request = static_cast<std::uint32_t>(request.size());
        out.metrics.n_request = out.n_request;

        // The state the request starts from: the slot's own (never another tenant's) or the
        // global cache entry selected for it (F21). The policy plans against its tokens and
        // every plan is checked before anything changes.
        const prompt_tokens no_tokens;
        const prompt_tokens& own = s.salt == ro.salt ? s.tokens : no_tokens;
        [[maybe_unused]] std::optional<typename cache_type::entry_id> pick;
        if constexpr (uses_global) {
            if (reuse_on) {
                lost_invalid = std::max(lost_invalid, global_->drop_invalid(*cache_, &request, ro.salt).max_lcp);
                if (auto sel = global_->find(request, ro.salt, own.common_prefix(request), own.size())) pick = sel->id;
            }
        }
        reuse::plan_options po;
        po.cache_prompt = reuse_on;
        po.can_shift = Cache::can_shift && opt_.n_swa == 0 && !has_recurrent_state;  // F23: no moves under a window
        auto make_plan = [&](const prompt_tokens& from) {
            reuse::plan p;
            p.n_request = out.n_request;
            if (reuse_on) {
                p = policy_.plan(from, request, po);
                reuse::check_plan(from, request, p, po, policy::needs_shift,
                                  "slot_manager::prepare (reuse policy " + std::string(policy::name) + ")");
            }
            return p;
        };
        // The policy is asked once per request (it may keep state): for the entry when one
        // was selected, else for the slot's own state; a second time, for the slot's own
        // state, only when the entry cannot be loaded.
        const prompt_tokens* source = &own;  // tokens the applied plan was made against
        if constexpr (uses_global)
            if (pick) source = global_->tokens_of(*pick);
        reuse::plan plan = make_plan(*source);
        // What the best state of another tenant (never reused) would have given.
        std::size_t lost_salt = 0;
        for (const slot& t : slots_)
            if (!t.busy && t.salt != ro.salt) lost_salt = std::max(lost_salt, t.tokens.common_prefix(request));

        if (s.salt != ro.salt) drop_state(s, seq);  // tenant isolation: never reuse another tenant's state
        s.salt = ro.salt;
        bool from_global = false;
        bool load_failed = false;
        if constexpr (uses_global) {
            if (pick) {
                // Park the slot's own state: a failed load puts it back as it was.
                parked_state parked = park(seq);
                auto got = global_->load(*cache_, seq, *pick);
                if (got) {
                    if (j_ != nullptr)
                        take_lent_checkpoints(s, static_cast<std::size_t>(id), *pick, std::move(got.value().checkpoints));
                    else {
                        drop_checkpoints(s, 0);
                        s.checkpoints = std::move(got.value().checkpoints);
                    }
                    s.tokens = std::move(got.value().tokens);
                    s.hits = got.value().hits;
                    from_global = true;
                    source = &s.tokens;  // the entry left the cache
                } else {
                    if (got.code() == errc::invalid_cell)
                        lost_invalid = std::max<std::size_t>(lost_invalid, plan.n_past);
                    else
                        load_failed = true;
                    if constexpr (can_park) {
                        unpark(seq, parked);
                        plan = make_plan(own);  // a refused plan throws now: the slot holds its own state again
                    } else {  // a memory whose cells slots cannot reach: the state is gone
                        drop_state(s, seq);
                        plan = reuse::plan{};
                        plan.n_request = out.n_request;
                    }
                    source = &s.tokens;
                }
            }
        }
        const std::uint32_t planned = plan.n_past;
        if ((opt_.n_swa > 0 || has_recurrent_state) && plan.n_past > 0)
            plan = checkpoint_adjust(s, seq, request, plan, out.metrics);
        const bool swa_cut = plan.n_past < planned;
        if (!reuse::apply_plan(*cache_, seq, plan)) {  // refused, nothing changed: recompute everything
            drop_state(s, seq);
            plan = reuse::plan{};
            plan.n_request = out.n_request;
            reuse::apply_plan(*cache_, seq, plan).value();  // an empty sequence: never refused
        }
        // The reuse stopped at a media position of both the request and its source.
        bool media_stop = plan.n_past < source->size() && (*source)[plan.n_past] == null_token &&
                          request.chunk_at(plan.n_past) != nullptr;
        const std::uint32_t planned_past = plan.n_past;  // what the slot / entry gave
        std::uint32_t kept = plan.n_past - plan.n_shifted();
        std::uint32_t shifted = plan.n_shifted();
        // Storage tiers (attach_tiers): a longer prefix replaces the sequence.
        if (reuse_on && tiers_.obj != nullptr && tiers_.opt.fetch_on_prepare && std::size_t{plan.n_past} + 1 < request.size()) {
            int tier_index = -1;
            const std::uint32_t n = tier_fetch(id, seq, plan.n_past, request, ro.salt, tier_index);
            if (n != plan.n_past) {  // replaced (or, a copy refused on a recurrent state, lost)
                if (n < plan.n_past) {
                    drop_state(s, seq);
                    kept = 0;
                } else {
                    out.metrics.from_tier = n - kept;
                    out.metrics.tier = tier_index;
                }
                shifted = 0;
                media_stop = false;
                plan = reuse::plan{};
                plan.n_request = out.n_request;
                plan.n_lcp = plan.n_past = n;
            }
        }
        s.tokens = request;
        s.tokens.keep_first(plan.n_past);
        {  // checkpoints at or beyond what the sequence holds now describe another state (increasing pos_max)
            const auto bound = static_cast<pos_t>(std::min(planned_past, plan.n_past));
            const auto first_stale = std::partition_point(s.checkpoints.begin(), s.checkpoints.end(),
                                                          [&](const checkpoint& ck) { return ck.pos_max < bound; });
            drop_checkpoints(s, static_cast<std::size_t>(first_stale - s.checkpoints.begin()));
        }
        make_room(plan.n_compute(), id);
        if (opt_.n_swa > 0 || has_recurrent_state) out.checkpoints = checkpoint_schedule(request, plan.n_past, ro);

        (from_global ? out.metrics.from_global : out.metrics.from_slot) = kept;
        out.metrics.from_shift = shifted;
        out.metrics.computed = plan.n_compute();
        out.metrics.miss = miss_of(request, plan.n_past, load_failed, lost_invalid, swa_cut, lost_salt, media_stop,
                                   reuse_on, ro.salt);
        prompt_tokens pending = request;  // the last allocation, before the slot turns busy
        request_options opts = ro;
        // F20: the K-shift last, after every other step that can throw (it is complete or
        // nothing itself, and it rotates K in place: the journal cannot undo it).
        if constexpr (Cache::can_shift && !std::same_as<Cache, recurrent_memory>)  // a state has no K to rotate
            if (opt_.apply_k_shift && cache_->has_shift()) ops::apply_k_shift(*cache_, opt_.n_threads);
        // Nothing below throws.
        count(out.metrics);
        out.n_past = plan.n_past;
        out.k_shift_pending = cache_->has_shift();
        out.plan = std::move(plan);
        s.busy = true;
        s.last_used = ++clock_;
        s.pending = std::move(pending);
        s.has_pending = true;
        s.opts = std::move(opts);
        last_ = out.metrics;
        return out;
    }

public:

    /// The host computed every position of the prepared request into the slot's sequence:
    /// the slot's tokens become the request. Throws invalid_argument if the slot has no
    /// prepared request or its sequence does not end at the request's last position.
    void commit_prompt(int slot_id) {
        slot& s = slots_[check_slot("commit_prompt", slot_id)];
        if (!s.busy || !s.has_pending)
            detail::fail(errc::invalid_argument, "slot_manager::commit_prompt: slot " + std::to_string(slot_id) +
                                                     " has no prepared request");
        const pos_t want = static_cast<pos_t>(s.pending.size()) - 1;
        const pos_t got = cache_->seq_pos_max(opt_.first_seq + slot_id);
        if (got != want)
            detail::fail(errc::invalid_argument, "slot_manager::commit_prompt: sequence " +
                                                     std::to_string(opt_.first_seq + slot_id) + " ends at position " +
                                                     std::to_string(got) + ", the request needs " + std::to_string(want));
        s.tokens = std::move(s.pending);
        s.pending.clear();
        s.has_pending = false;
        s.generation = detail::seq_fingerprint(*cache_, opt_.first_seq + slot_id);
    }

    /// A generated token was placed at position tokens(slot).size() of the slot's sequence.
    void append(int slot_id, token_t t) {
        slot& s = slots_[check_slot("append", slot_id)];
        if (!s.busy || s.has_pending)
            detail::fail(errc::invalid_argument, "slot_manager::append: slot " + std::to_string(slot_id) +
                                                     " is not generating (prepare and commit_prompt first)");
        const pos_t got = cache_->seq_pos_max(opt_.first_seq + slot_id);
        if (got != static_cast<pos_t>(s.tokens.size()))
            detail::fail(errc::invalid_argument, "slot_manager::append: sequence ends at position " +
                                                     std::to_string(got) + ", expected the new token at " +
                                                     std::to_string(s.tokens.size()));
        s.tokens.push_back(t);
        s.generation = detail::seq_fingerprint(*cache_, opt_.first_seq + slot_id);
    }

    /// Saves the slot's state at its current positions: a sliding-window state (F23) or a
    /// recurrent / hybrid memory's sequence (see the file comment; call it at the positions
    /// prepared_request::checkpoints lists). A checkpoint at a position the slot already
    /// has one for replaces it. The oldest checkpoints are dropped beyond max_checkpoints
    /// and max_checkpoint_bytes (never the new one; counted: checkpoints_dropped). Returns
    /// the store's error result (e.g. no_space) when it refuses, nothing changed. Throws
    /// invalid_argument (bad slot) or transaction_open (placements staged).
    [[nodiscard]] result<void> save_checkpoint(int slot_id) {
        slot& s = slots_[check_slot("save_checkpoint", slot_id)];
        if (cache_->in_transaction())
            detail::fail(errc::transaction_open, "slot_manager::save_checkpoint: placements are staged; commit() or restore() first");
        const seq_id_t seq = opt_.first_seq + slot_id;
        if (cache_->seq_pos_max(seq) < 0) return {};
        const pos_t mx = cache_->seq_pos_max(seq);
        s.checkpoints.reserve(s.checkpoints.size() + 1);  // push_back below cannot throw after the save
        auto h = store().save(*cache_, seq);
        if (!h) return detail::make_error(h.code(), "slot_manager::save_checkpoint: " + h.message());
        s.checkpoints.push_back({window_pos_min(seq), mx, std::move(h).value()});
        ++counters_.checkpoints_saved;
        // Keep pos_max increasing: a checkpoint at or beyond this one is older news.
        std::erase_if(s.checkpoints, [&](checkpoint& ck) {
            if (&ck == &s.checkpoints.back() || ck.pos_max < mx) return false;
            store().release(*cache_, ck.state);
            return true;
        });
        auto over = [&] {
            if (s.checkpoints.size() <= 1) return false;
            if (s.checkpoints.size() > std::max<std::uint32_t>(1, opt_.max_checkpoints)) return true;
            return opt_.max_checkpoint_bytes > 0 && checkpoint_bytes(slot_id) > opt_.max_checkpoint_bytes;
        };
        while (over()) {
            store().release(*cache_, s.checkpoints.front().state);
            s.checkpoints.erase(s.checkpoints.begin());
            ++counters_.checkpoints_dropped;
        }
        return {};
    }

    /// Ends the slot's request: the slot becomes idle and keeps its tokens and K/V; with
    /// reuse::global its state is also saved into the global prompt cache (F21). Positions
    /// the host placed but did not commit (commit_prompt / append) are removed first, so the
    /// sequence holds exactly tokens(slot); when the layout refuses that truncation (a ring
    /// whose window pruned the positions the next token would need) the slot's state is
    /// dropped instead. Throws transaction_open if placements are staged.
    /// Under std::bad_alloc: bit-identical (the slot stays busy, everything as before the
    /// call, a dropped state included, through prepare's journal; call release() again).
    /// Without the journal (a store whose release may throw) removed uncommitted
    /// positions may stay removed, and when the slot's state had to be dropped (the host
    /// changed the slot's cells, or the layout refused the truncation) the slot stays busy
    /// holding nothing that can be served.
    void release(int slot_id) {
        slot& s = slots_[check_slot("release", slot_id)];
        if (!s.busy) return;
        if (cache_->in_transaction())
            detail::fail(errc::transaction_open, "slot_manager::release: placements are staged; commit() or restore() first");
        journaled(false, [&] { release_steps(slot_id); });
    }

private:
    /// release() once the arguments are checked (under the journal where there is one).
    void release_steps(int slot_id) {
        slot& s = slots_[static_cast<std::size_t>(slot_id)];
        const seq_id_t seq = opt_.first_seq + slot_id;
        const bool changed = s.generation != detail::seq_fingerprint(*cache_, seq);  // since the last commit_prompt / append
        // Undo record of the uncommitted positions removed below: a throw afterwards (the
        // global save, std::bad_alloc) puts them back (a cache checkpoint; no K/V byte is
        // written by the removal), unless the slot's state had to be dropped (compound).
        constexpr bool can_undo = requires { typename Cache::checkpoint; };
        [[maybe_unused]] typename detail::checkpoint_or<Cache>::type cp{};
        bool undo = false;
        bool dropped = false;
        try {
            if (cache_->seq_pos_max(seq) >= static_cast<pos_t>(s.tokens.size())) {
                if constexpr (can_undo) {
                    cache_->save_checkpoint(cp, detail::internal_access{});
                    undo = true;
                }
                if (!cache_->seq_rm(seq, static_cast<pos_t>(s.tokens.size()), -1)) {
                    dropped = true;
                    drop_state(s, seq);
                }
            }
            if (changed && !holds_exactly(seq, s.tokens.size())) {  // the host changed more than uncommitted positions
                if (!s.tokens.empty()) ++counters_.slot_states_invalidated;
                dropped = true;
                drop_state(s, seq);
            }
            if constexpr (uses_global) {
                if (s.opts.cache_prompt && !s.tokens.empty()) {
                    std::vector<checkpoint> cks;
                    if constexpr (std::is_copy_constructible_v<typename Store::handle> && copyable_handles)
                        cks = s.checkpoints;
                    global_->save(*cache_, seq, s.tokens,
                                  {s.salt, s.opts.priority, s.opts.pin, s.hits}, std::move(cks));
                }
            }
        } catch (...) {
            if constexpr (can_undo)
                if (undo && !dropped) cache_->load_checkpoint(cp, detail::internal_access{});
            throw;
        }
        // The storage tiers (attach_tiers) after the global save; best effort. The queued
        // promotions first (prepare's deferred ones): a failure is counted, never thrown.
        if (tiers_.obj != nullptr) {
            try {
                tiers_.promote_pending(tiers_.obj);
            } catch (const std::exception&) {
                ++counters_.tier_publish_errors;
            }
        }
        if (tiers_.obj != nullptr && tiers_.opt.publish_on_release && s.opts.cache_prompt && !s.tokens.empty()) {
            try {
                tiers_.publish(tiers_.obj, *cache_, seq, s.tokens, s.salt);
            } catch (const std::exception&) {  // std::bad_alloc, a tier's own error: the slot is not lost
                ++counters_.tier_publish_errors;
            }
        }
        // Idle only once the save is done: when it throws (std::bad_alloc) the slot stays
        // busy, holding exactly its tokens, and release() can be called again.
        s.busy = false;
        s.has_pending = false;
        s.pending.clear();
        s.generation = detail::seq_fingerprint(*cache_, seq);
    }

public:
    /// Empties the slot (its sequence and tokens); the slot must be idle.
    void clear_slot(int slot_id) {
        slot& s = slots_[check_slot("clear_slot", slot_id)];
        if (s.busy) detail::fail(errc::invalid_argument, "slot_manager::clear_slot: slot " + std::to_string(slot_id) + " is busy");
        drop_state(s, opt_.first_seq + slot_id);
    }

    /// Metrics of the last prepared request.
    [[nodiscard]] const request_metrics& last_metrics() const noexcept { return last_; }

private:
    static constexpr bool copyable_handles = [] {
        if constexpr (requires { Store::copyable_handles; }) return static_cast<bool>(Store::copyable_handles);
        else return false;
    }();

    struct slot {
        prompt_tokens tokens;       // what the slot's sequence holds, position i = tokens[i]
        prompt_tokens pending;      // the prepared request until commit_prompt
        bool has_pending = false;
        bool busy = false;
        std::uint64_t last_used = 0;  // logical clock of the last prepare
        std::uint64_t salt = 0;       // tenant whose state the slot holds
        std::uint64_t hits = 0;       // global-cache hits of the state (carried into the entry)
        request_options opts;
        std::vector<checkpoint> checkpoints;  // F23, increasing pos_max
        std::uint64_t generation = 0;         // seq_fingerprint of the sequence when the slot last checked it
    };

    Store& store() {
        if constexpr (uses_global) return global_->store();
        else return own_store_;
    }

    /// Smallest position of seq the sliding-window attention still sees: the ISWA cache's
    /// ring part, else the cache itself.
    pos_t window_pos_min(seq_id_t seq) const {
        if constexpr (requires { cache_->window_pos_min(seq); })
            return cache_->window_pos_min(seq);
        else
            return cache_->seq_pos_min(seq);
    }

    std::size_t check_slot(const char* fn, int slot_id) const {
        if (slot_id < 0 || static_cast<std::size_t>(slot_id) >= slots_.size())
            detail::fail(errc::invalid_argument, std::string("slot_manager::") + fn + ": slot = " +
                                                     std::to_string(slot_id) + ", must be in [0, " +
                                                     std::to_string(slots_.size()) + ")");
        return static_cast<std::size_t>(slot_id);
    }

    /// F22: explicit id, else the idle slot with the longest prefix above the similarity
    /// threshold (same tenant), else the least recently used idle slot; -1 when every slot is busy.
    int pick_slot(const prompt_tokens& request, const request_options& ro, bool reuse_on) const {
        if (ro.slot_id >= 0) {
            const std::size_t i = check_slot("prepare", ro.slot_id);
            if (slots_[i].busy)
                detail::fail(errc::invalid_argument, "slot_manager::prepare: slot_id = " + std::to_string(ro.slot_id) + " is busy");
            return ro.slot_id;
        }
        int best = -1;
        std::size_t best_lcp = 0;
        if (reuse_on) {
            for (std::size_t i = 0; i < slots_.size(); ++i) {
                const slot& s = slots_[i];
                if (s.busy || s.salt != ro.salt) continue;
                const std::size_t lcp = s.tokens.common_prefix(request);
                const double sim = static_cast<double>(lcp) / static_cast<double>(request.size());
                if (lcp > best_lcp && sim > opt_.similarity) {
                    best = static_cast<int>(i);
                    best_lcp = lcp;
                }
            }
        }
        if (best >= 0) return best;
        for (std::size_t i = 0; i < slots_.size(); ++i)
            if (!slots_[i].busy && (best < 0 || slots_[i].last_used < slots_[static_cast<std::size_t>(best)].last_used))
                best = static_cast<int>(i);
        return best;  // -1: every slot is busy
    }

    void drop_state(slot& s, seq_id_t seq) {
        touch(static_cast<std::size_t>(&s - slots_.data()));
        cache_->seq_rm(seq, -1, -1).value();  // the whole sequence: never refused
        drop_checkpoints(s, 0);
        s.tokens.clear();
        s.hits = 0;
        s.generation = detail::seq_fingerprint(*cache_, seq);
    }

    // ---------------------------------------------------------------- prepare's journal
    // prepare() and release() run under an undo journal (every memory: Cache::journal_mark):
    // a checkpoint of the cache's metadata (a recurrent memory's intervals), its guard (the
    // K/V of cells that were occupied when prepare began and are written again; the state
    // of a recurrent sequence before it is overwritten), the global prompt
    // cache's batch (removals recorded, not yet dropped), the store's undo record (an
    // undoable store without a global cache), the slots it changes (as they were) and the
    // counters. A throw anywhere puts all of it back; the K-shift runs last (it is complete
    // or nothing, and rotates in place). Checkpoints a slot drops are released when prepare
    // returns (stores whose release cannot throw) or at once on a copy of the handle
    // (undoable stores, whose record puts the cells back).
    static constexpr bool store_undoable = detail::undoable_store<Store, Cache>;
    /// A memory with checkpoints, and a store that undoes its own changes or whose
    /// release() cannot throw (a custom store with a throwing release: compound).
    static constexpr bool strong_prepare =
        requires(Cache& c, typename Cache::journal_mark& m, detail::internal_access a) {
            c.save_journal(m, a);
            c.load_journal(m, a);
            c.begin_guard(m, a);
            c.end_guard(a);
            c.rollback_guard(a);
        } &&
        (store_undoable ||
         noexcept(std::declval<Store&>().release(std::declval<Cache&>(), std::declval<typename Store::handle&>())));

    template <class C>
    struct journal_mark_or {
        using type = std::monostate;
    };
    template <class C>
        requires requires { typename C::journal_mark; }
    struct journal_mark_or<C> {
        using type = typename C::journal_mark;
    };
    /// A slot as it was when prepare first changed it.
    struct saved_slot {
        std::size_t index = 0;
        slot before;                          // as it was, but for its checkpoints (below)
        bool live_is_orig = true;             // the slot's checkpoints are still (a prefix of) its own
        std::vector<checkpoint> dropped_orig;  // its own checkpoints dropped so far, in order
    };
    struct journal {
        typename journal_mark_or<Cache>::type cp{};
        [[no_unique_address]] typename detail::undo_record_or<Store, store_undoable && !uses_global>::type store_undo{};
        std::vector<saved_slot> saved;        // room for every slot
        // The global entry prepare loaded lends its checkpoints (no copy): those the slot
        // dropped since, in order (a prefix stays in the slot); given back on a rollback.
        std::optional<typename cache_type::entry_id> lent;
        std::vector<checkpoint> lent_dropped;
        prefix_cache_metrics counters;
        std::uint64_t clock = 0;
        request_metrics last;
    };
    journal* j_ = nullptr;

    /// batch: the global prompt cache's removals are recorded (prepare); release() saves
    /// into it instead (a save is strong by itself and the last step that can throw).
    void open_journal(journal& j, bool batch) {
        j.saved.reserve(slots_.size());
        j.counters = counters_;
        j.clock = clock_;
        j.last = last_;
        cache_->save_journal(j.cp, detail::internal_access{});
        if constexpr (store_undoable && !uses_global) store().save_undo(*cache_, j.store_undo);
        if constexpr (uses_global)
            if (batch) global_->begin_batch(*cache_, detail::internal_access{});
        try {
            cache_->begin_guard(j.cp, detail::internal_access{});
        } catch (...) {
            if constexpr (uses_global) global_->rollback_batch(*cache_, detail::internal_access{});
            throw;
        }
        j_ = &j;
    }
    /// Runs f() under a journal (the memories with checkpoints), else as it is.
    template <class F>
    decltype(auto) journaled(bool batch, F&& f) {
        if constexpr (strong_prepare) {
            journal j;
            open_journal(j, batch);  // may throw std::bad_alloc: nothing changed yet
            try {
                if constexpr (std::is_void_v<decltype(f())>) {
                    f();
                    close_journal(j);
                } else {
                    auto out = f();
                    close_journal(j);
                    return out;
                }
            } catch (...) {
                rollback_journal(j);
                throw;
            }
        } else {
            return f();
        }
    }
    /// prepare succeeded: the dropped checkpoints are released, the batch's removals dropped.
    void close_journal(journal& j) noexcept {
        j_ = nullptr;
        if constexpr (!store_undoable) {  // release() cannot throw (strong_prepare)
            for (saved_slot& sv : j.saved)
                for (checkpoint& ck : sv.dropped_orig) store().release(*cache_, ck.state);
            for (checkpoint& ck : j.lent_dropped) store().release(*cache_, ck.state);
        }
        if constexpr (uses_global) global_->commit_batch(*cache_, detail::internal_access{});
        cache_->end_guard(detail::internal_access{});
    }
    /// prepare threw: everything back as it was (never throws).
    void rollback_journal(journal& j) noexcept {
        j_ = nullptr;
        static_assert(std::is_nothrow_move_assignable_v<slot>);
        for (saved_slot& sv : j.saved) {
            slot& s = slots_[sv.index];
            std::vector<checkpoint> live = std::move(s.checkpoints);
            s = std::move(sv.before);
            if (sv.live_is_orig) {  // a prefix of its own is left: the dropped suffix goes back (room kept)
                for (checkpoint& ck : sv.dropped_orig) live.push_back(std::move(ck));
                s.checkpoints = std::move(live);
            } else {  // a global entry's lent checkpoints: back to the entry, whole (room kept)
                if constexpr (uses_global) {
                    for (checkpoint& ck : j.lent_dropped) live.push_back(std::move(ck));
                    global_->give_back(*j.lent, std::move(live), detail::internal_access{});
                }
                s.checkpoints = std::move(sv.dropped_orig);
            }
        }
        if constexpr (uses_global) global_->rollback_batch(*cache_, detail::internal_access{});
        if constexpr (store_undoable && !uses_global) store().load_undo(*cache_, j.store_undo);
        cache_->load_journal(j.cp, detail::internal_access{});
        cache_->rollback_guard(detail::internal_access{});
        counters_ = j.counters;
        clock_ = j.clock;
        last_ = j.last;
    }
    /// Records slot i as it is before prepare's first change to it (no journal: nothing).
    void touch(std::size_t i) {
        if (j_ == nullptr) return;
        for (const saved_slot& sv : j_->saved)
            if (sv.index == i) return;
        slot& s = slots_[i];
        saved_slot sv;
        sv.index = i;
        sv.dropped_orig.reserve(s.checkpoints.size());
        std::vector<checkpoint> cks = std::move(s.checkpoints);  // not copied: the journal keeps what is dropped
        try {
            sv.before = s;
        } catch (...) {
            s.checkpoints = std::move(cks);
            throw;
        }
        s.checkpoints = std::move(cks);
        j_->saved.push_back(std::move(sv));  // within the reserved room
    }
    saved_slot& saved_of(std::size_t i) noexcept {
        for (saved_slot& sv : j_->saved)
            if (sv.index == i) return sv;
        KVCACHE_ASSERT(false);
        return j_->saved.front();
    }
    /// Under the journal: the slot takes the checkpoints a global entry lent (before
    /// anything that can throw, so that a rollback gives them back whole); its own go to
    /// the journal, their cells released last (undoable stores).
    template <class Id>
    void take_lent_checkpoints(slot& s, std::size_t i, Id id, std::vector<checkpoint>&& lent) {
        saved_slot& sv = saved_of(i);
        KVCACHE_ASSERT(sv.live_is_orig);
        const std::size_t n_own = s.checkpoints.size();
        sv.dropped_orig.insert(sv.dropped_orig.begin(), std::make_move_iterator(s.checkpoints.begin()),
                               std::make_move_iterator(s.checkpoints.end()));  // within the reserved room
        s.checkpoints = std::move(lent);
        sv.live_is_orig = false;
        j_->lent = id;
        j_->lent_dropped.reserve(s.checkpoints.size());  // drop_checkpoints' room from here on
        if constexpr (store_undoable)
            for (std::size_t c = 0; c < n_own; ++c) {
                auto h = sv.dropped_orig[c].state;
                store().release(*cache_, h);
            }
    }
    /// Drops the slot's checkpoints from index k on (released; under the journal kept
    /// until prepare returns, see above).
    void drop_checkpoints(slot& s, std::size_t k) {
        if (k >= s.checkpoints.size()) return;
        if (j_ == nullptr) {
            for (std::size_t i = k; i < s.checkpoints.size(); ++i) store().release(*cache_, s.checkpoints[i].state);
            s.checkpoints.erase(s.checkpoints.begin() + static_cast<std::ptrdiff_t>(k), s.checkpoints.end());
            return;
        }
        const std::size_t i = static_cast<std::size_t>(&s - slots_.data());
        touch(i);
        saved_slot& sv = saved_of(i);
        if constexpr (store_undoable)  // the cells go now (the undo records put them back); the handles stay
            for (std::size_t c = k; c < s.checkpoints.size(); ++c) {
                auto h = s.checkpoints[c].state;
                store().release(*cache_, h);
            }
        const auto first = s.checkpoints.begin() + static_cast<std::ptrdiff_t>(k);
        // Before the suffixes dropped earlier (within the room reserved when the slot was
        // touched, or when the entry lent its checkpoints): never allocates.
        std::vector<checkpoint>& to = sv.live_is_orig ? sv.dropped_orig : j_->lent_dropped;
        to.insert(to.begin(), std::make_move_iterator(first), std::make_move_iterator(s.checkpoints.end()));
        s.checkpoints.erase(first, s.checkpoints.end());
    }

    /// Whether seq holds exactly positions [0, n) once each (under a window: ends at n - 1).
    bool holds_exactly(seq_id_t seq, std::size_t n) const {
        if (cache_->seq_pos_max(seq) != static_cast<pos_t>(n) - 1) return false;
        if (opt_.n_swa > 0 || n == 0) return true;
        if (cache_->seq_pos_min(seq) != 0) return false;
        if constexpr (kv_memory<Cache>) return cache_->cells().seq_cell_count(seq) == n;
        else return true;
    }

    /// Whether a failed global load can put the slot's own state back: the cells are
    /// reachable (kv_memory, or a composite memory of kv_memory parts).
    static constexpr bool can_park = kv_memory<Cache> || composite_memory<Cache>;
    /// Calls f on each cell-indexed part of the cache (the cache itself, or an iswa_cache's two).
    template <class F>
    void for_each_kv_part(F&& f) {
        if constexpr (kv_memory<Cache>)
            f(*cache_);
        else if constexpr (composite_memory<Cache>)
            cache_->for_each_part(detail::internal_access{}, f);
    }
    struct parked_cell {
        std::uint32_t cell;
        pos_t pos;
        std::int32_t shift;
        mrope_pos ext;
    };
    struct parked_part {
        std::vector<parked_cell> cells;
        pos_t pruned = 0;
    };
    using parked_state = std::vector<parked_part>;

    /// Empties seq, remembering its cells: unpark() puts them back when what was tried
    /// instead (a global load, which changes nothing when it fails) did not happen. The
    /// cells' K/V bytes stay where they are meanwhile (freeing a cell writes none).
    parked_state park(seq_id_t seq) {
        parked_state out;
        for_each_kv_part([&](auto& part) {
            using part_t = std::remove_cvref_t<decltype(part)>;
            parked_part pp;
            const cell_table& ct = part.cells();
            for (std::uint32_t c : ct.used_cells())
                if (ct.seqs(c).test(seq)) pp.cells.push_back({c, ct.pos(c), ct.shift(c), ct.ext(c)});
            if constexpr (has_capability<typename part_t::storage_t, layout_caps::pruning>)
                pp.pruned = part.storage().pruned_below(seq);
            out.push_back(std::move(pp));
        });
        cache_->seq_rm(seq, -1, -1).value();  // the whole sequence: never refused
        return out;
    }
    void unpark(seq_id_t seq, const parked_state& st) {
        cache_->seq_rm(seq, -1, -1).value();  // empty after a failed load; made sure
        std::size_t i = 0;
        for_each_kv_part([&](auto& part) {
            using part_t = std::remove_cvref_t<decltype(part)>;
            const parked_part& pp = st[i++];
            cell_table& ct = part.cells_for_update(detail::internal_access{});
            for (const parked_cell& pc : pp.cells) {
                if (ct.is_free(pc.cell)) {
                    ct.occupy(pc.cell, pc.pos, seq_set::of(seq), pc.ext);
                    ct.set_shift(pc.cell, pc.shift);
                } else {  // still held by the sequences that shared it
                    KVCACHE_ASSERT(ct.pos(pc.cell) == pc.pos);
                    ct.add_seq(pc.cell, seq);
                }
            }
            if constexpr (has_capability<typename part_t::storage_t, layout_caps::pruning>)
                part.storage().set_pruned_below(seq, pp.pruned);
        });
    }

    /// The first reason (miss_reason order) why the request reused n_past tokens and not more.
    miss_reason miss_of(const prompt_tokens& request, std::uint32_t n_past, bool load_failed, std::size_t lost_invalid,
                        bool swa_cut, std::size_t lost_salt, bool media_stop, bool reuse_on, std::uint64_t salt) const {
        if (!reuse_on) return miss_reason::none;
        const std::size_t cap = request.size() - 1;  // the last position is always computed (its logits)
        auto lost = [&](std::size_t could) { return std::min(could, cap) > n_past; };
        if (load_failed) return miss_reason::load_failed;
        if (lost(lost_invalid)) return miss_reason::invalidated;
        if (swa_cut) return has_recurrent_state && opt_.n_swa == 0 ? miss_reason::no_checkpoint : miss_reason::swa;
        if (lost(lost_salt)) return miss_reason::salt;
        if (n_past < cap && media_stop) return miss_reason::media;
        if constexpr (uses_global)
            if (lost(global_->evicted_lcp(request, salt))) return miss_reason::evicted;
        static_cast<void>(salt);
        return miss_reason::none;
    }

    void count(const request_metrics& m) {
        ++counters_.requests;
        counters_.query_tokens += m.n_request;
        counters_.hit_tokens += m.hit_tokens();
        counters_.hit_tokens_slot += m.from_slot;
        counters_.hit_tokens_global += m.from_global;
        counters_.hit_tokens_shifted += m.from_shift;
        counters_.hit_tokens_tier += m.from_tier;
        if (m.miss != miss_reason::none) ++counters_.misses[static_cast<std::size_t>(m.miss)];
        if (m.checkpoint_restored) ++counters_.checkpoints_restored;
    }

    /// The lowest position the query at position n sees under the window: a query at p
    /// sees keys (p - n_swa, p] (ops::attention's window, the ring layout's pruning).
    std::int64_t window_floor(std::int64_t n) const noexcept {
        return std::max<std::int64_t>(0, n - std::int64_t{opt_.n_swa} + 1);
    }

    /// F23: a sliding-window sequence cannot re-enter a prefix whose window was overwritten
    /// (re-entering at n_past needs the positions the query at n_past sees, window_floor),
    /// and a recurrent state cannot be rolled back below its last position. Continue from
    /// the newest checkpoint at or below n_past, or recompute everything.
    reuse::plan checkpoint_adjust(slot& s, seq_id_t seq, const prompt_tokens& request, const reuse::plan& p,
                                  request_metrics& m) {
        const bool window_ok = opt_.n_swa == 0 || window_pos_min(seq) <= window_floor(p.n_past);
        const bool state_ok = !has_recurrent_state || cache_->seq_pos_max(seq) < static_cast<pos_t>(p.n_past);
        if (window_ok && state_ok) return p;
        reuse::plan q;
        q.n_request = p.n_request;
        for (auto it = s.checkpoints.rbegin(); it != s.checkpoints.rend(); ++it) {
            const std::int64_t n = std::int64_t{it->pos_max} + 1;
            if (n > p.n_past || (opt_.n_swa > 0 && it->pos_min > window_floor(n))) continue;
            if (request.cuts_chunk(static_cast<std::size_t>(n))) continue;
            cache_->seq_rm(seq, -1, -1).value();  // the whole sequence: never refused
            if (!store().load(*cache_, seq, it->state)) break;
            q.n_lcp = q.n_past = static_cast<std::uint32_t>(n);
            m.checkpoint_restored = true;
            return q;
        }
        cache_->seq_rm(seq, -1, -1).value();
        return q;
    }

    /// Where the host should save checkpoints while it computes request positions
    /// [n_past, n_request): see prepared_request::checkpoints.
    std::vector<std::uint32_t> checkpoint_schedule(const prompt_tokens& request, std::uint32_t n_past,
                                                   const request_options& ro) const {
        const auto n = static_cast<std::uint32_t>(request.size());
        std::vector<std::uint32_t> out;
        auto add = [&](std::uint64_t b) {
            if (b > n_past && b < n && !request.cuts_chunk(static_cast<std::size_t>(b)))
                out.push_back(static_cast<std::uint32_t>(b));
        };
        if (opt_.checkpoint_every > 0)
            for (std::uint64_t b = opt_.checkpoint_every; b < n; b += opt_.checkpoint_every) add(b);
        if (opt_.checkpoint_tail > 0 && opt_.checkpoint_tail < n) add(n - opt_.checkpoint_tail);
        for (std::uint32_t b : ro.checkpoint_at) add(b);
        std::sort(out.begin(), out.end());
        out.erase(std::unique(out.begin(), out.end()), out.end());
        return out;
    }

    /// Makes room for the n positions the host computes next into the sequence of slot
    /// `self` (the slot being prepared). When they do not fit (has_room: free blocks on a
    /// paged layout, free cells otherwise), evicts, in this order, until they fit:
    ///  1. global prompt-cache entries that hold cells of the cache (shared_store), in the
    ///     prompt cache's eviction order, never a pinned one (prompt-cache `evictions`);
    ///  2. the states of idle slots, least recently used first, never a busy slot and never
    ///     `self` (slot_states_evicted).
    /// Complete or nothing: when even evicting all of them would not make room, nothing is
    /// evicted (room_refused) and the host's placement meets no_space. A kv_memory only (a
    /// composite memory, or a ring layout, whose window prunes positions, keeps its idle
    /// slot states; with shared_store its entries are evicted as before).
    void make_room(std::uint32_t n, int self) {
        const seq_id_t seq = opt_.first_seq + self;
        if constexpr (kv_memory<Cache> && !forgets) {
            if (has_room(n, seq)) return;
            // Everything eviction may remove: entry sequences and idle slots' sequences.
            seq_set all;
            if constexpr (uses_global && holds_cells)
                global_->for_each_evictable_handle([&](const auto& h) {
                    if (h.seq >= 0) all.set(h.seq);
                });
            for (std::size_t i = 0; i < slots_.size(); ++i) {
                if (static_cast<int>(i) == self || slots_[i].busy) continue;
                all.set(opt_.first_seq + static_cast<seq_id_t>(i));
                if constexpr (holds_cells)
                    for (const auto& ck : slots_[i].checkpoints)
                        if (ck.state.seq >= 0) all.set(ck.state.seq);
            }
            if (free_units_without(all) < need_units(n, seq)) {
                ++counters_.room_refused;
                return;
            }
            if constexpr (uses_global && holds_cells)
                while (!has_room(n, seq) && global_->evict_one(*cache_)) {
                }
            while (!has_room(n, seq)) {
                int lru = -1;
                for (std::size_t i = 0; i < slots_.size(); ++i) {
                    const slot& t = slots_[i];
                    if (static_cast<int>(i) == self || t.busy || (t.tokens.empty() && t.checkpoints.empty() &&
                                                                  cache_->seq_pos_max(opt_.first_seq + static_cast<seq_id_t>(i)) < 0))
                        continue;
                    if (lru < 0 || t.last_used < slots_[static_cast<std::size_t>(lru)].last_used) lru = static_cast<int>(i);
                }
                if (lru < 0) break;  // cannot happen: evicting everything makes room (checked above)
                ++counters_.slot_states_evicted;
                drop_state(slots_[static_cast<std::size_t>(lru)], opt_.first_seq + lru);
            }
        } else if constexpr (uses_global && holds_cells) {
            while (!has_room(n, seq) && global_->evict_one(*cache_)) {
            }
        }
    }
    /// Whether the layout prunes positions out of a window (ring): n tokens need fewer cells.
    static constexpr bool forgets = [] {
        if constexpr (requires { typename Cache::storage_t; })
            return has_capability<typename Cache::storage_t, layout_caps::pruning>;
        else
            return false;
    }();
    /// Whether the store's entries are sequences of the cache (shared_store).
    static constexpr bool holds_cells = requires(Store& st, typename Store::handle h) {
        st.n_free();
        { h.seq } -> std::convertible_to<seq_id_t>;
    };
    /// What n more tokens of seq need: blocks on a paged layout (one more than n tokens fill
    /// when seq holds cells: its last block may be shared, copy-on-write, or full), cells
    /// otherwise.
    std::uint64_t need_units(std::uint32_t n, seq_id_t seq) const {
        if constexpr (requires { cache_->storage().free_blocks(); Cache::layout::block_size; }) {
            constexpr std::uint64_t bs = Cache::layout::block_size;
            return (std::uint64_t{n} + bs - 1) / bs + (cache_->seq_pos_max(seq) >= 0 ? 1 : 0);
        } else {
            return n;
        }
    }
    /// Whether n more tokens of seq fit now.
    bool has_room(std::uint32_t n, seq_id_t seq) const {
        if constexpr (requires { cache_->storage().free_blocks(); Cache::layout::block_size; })
            return cache_->storage().free_blocks() >= need_units(n, seq);
        else
            return cache_->capacity() - cache_->used() >= need_units(n, seq);
    }
    /// Free blocks (paged) or cells once every sequence of `gone` were removed: those whose
    /// cells are free or used by sequences of `gone` only.
    std::uint64_t free_units_without(const seq_set& gone) const requires kv_memory<Cache> {
        const cell_table& ct = cache_->cells();
        auto freed = [&](std::uint32_t c) {
            if (ct.is_free(c)) return true;
            bool only = true;
            ct.seqs(c).for_each([&](seq_id_t s) { only = only && gone.test(s); });
            return only;
        };
        std::uint64_t out = 0;
        if constexpr (requires { cache_->storage().free_blocks(); Cache::layout::block_size; }) {
            constexpr std::uint32_t bs = Cache::layout::block_size;
            for (std::uint32_t b = 0; b < cache_->storage().n_blocks(); ++b) {
                bool all = true;
                for (std::uint32_t c = b * bs; all && c < (b + 1) * bs; ++c) all = freed(c);
                out += all ? 1 : 0;
            }
        } else {
            for (std::uint32_t c = 0; c < ct.size(); ++c) out += freed(c) ? 1 : 0;
        }
        return out;
    }

    Cache* cache_;
    slot_options opt_;
    [[no_unique_address]] policy policy_{};
    std::vector<slot> slots_;
    std::optional<cache_type> global_;  // engaged exactly with reuse::global
    [[no_unique_address]] std::conditional_t<uses_global, std::monostate, Store> own_store_{};
    std::uint64_t clock_ = 0;
    request_metrics last_;
    prefix_cache_metrics counters_;  // request and token counters (the entry counters live in global_)

    /// The attached tier chain, its type erased (attach_tiers).
    struct tier_hook {
        void* obj = nullptr;
        tier_hook_options opt{};
        tier::fetch_info (*fetch)(void*, Cache&, seq_id_t, const prompt_tokens&, std::uint64_t, std::size_t,
                                  tier::promotion) = nullptr;
        void (*promote_pending)(void*) = nullptr;
        void (*publish)(void*, const Cache&, seq_id_t, const prompt_tokens&, std::uint64_t) = nullptr;
        tier::tier_cache_metrics (*metrics)(void*) = nullptr;
    };
    tier_hook tiers_;

    /// Sequence seq holds the first `have` positions of the request (what the plan kept).
    /// Fetches the request from the tiers into the scratch sequence and, when they give
    /// more, makes seq hold those instead (tier_index: the tier). Returns the positions seq
    /// holds: have on a miss, a shorter hit, a refused copy (the slot's cells put back) or
    /// std::bad_alloc (counted); 0 only on a memory whose cells cannot be put back
    /// (recurrent_memory) when the copy is refused. The scratch sequence is empty afterwards.
    /// A longer blob that found no free cells (fetch_info::no_room) gets one retry after
    /// make_room evicted idle slot states and global entries for it (never slot self).
    std::uint32_t tier_fetch(int self, seq_id_t seq, std::uint32_t have, const prompt_tokens& request, std::uint64_t salt,
                             int& tier_index) {
        const seq_id_t sc = tiers_.opt.scratch_seq;
        std::uint32_t out = have;
        [[maybe_unused]] std::optional<parked_state> parked;  // can_park: the plan's cells while the copy runs
        [[maybe_unused]] bool removed = false;                // otherwise: seq was emptied for the copy
        try {
            tier::fetch_info f = tiers_.fetch(tiers_.obj, *cache_, sc, request, salt, request.size() - 1, tiers_.opt.promote);
            if (f.n_tokens <= have && f.no_room > have) {
                if (f.n_tokens > 0) cache_->seq_rm(sc, -1, -1).value();  // the shorter hit gives way
                make_room(f.no_room, self);
                f = tiers_.fetch(tiers_.obj, *cache_, sc, request, salt, request.size() - 1, tiers_.opt.promote);
            }
            if (f.n_tokens > have) {
                if constexpr (can_park) {
                    parked.emplace(park(seq));  // allocates before it changes anything
                } else {
                    removed = true;
                    cache_->seq_rm(seq, -1, -1).value();  // the whole sequence: never refused
                }
                if (cache_->seq_cp(sc, seq, -1, -1)) {
                    out = f.n_tokens;
                    tier_index = f.tier;
                } else if constexpr (can_park) {
                    unpark(seq, *parked);
                } else {
                    out = 0;
                }
            }
        } catch (const std::bad_alloc&) {  // seq_cp is complete or nothing
            ++counters_.tier_fetch_errors;
            if constexpr (can_park) {
                if (parked) unpark(seq, *parked);
            } else if (removed) {
                out = 0;
            }
        }
        cache_->seq_rm(sc, -1, -1).value();  // the whole sequence: never refused
        return out;
    }
};

KVCACHE_END_NAMESPACE
