// kvcache: the global prompt cache (F21): released slot states (tokens, K/V state
// and SWA checkpoints) kept across slots under a byte limit and a token limit,
// indexed by a radix tree so that lookup costs O(request length), isolated per
// tenant (salt), evicted in the order of an eviction policy.
//
// Selection rule (llama-server's, made deterministic): with lcp = common prefix of
// the entry and the request, f_keep = lcp / entry length, sim = lcp / request
// length, an entry qualifies if
//   - f_keep >= 0.25 and it beats the slot's own state on both f_keep and sim, or
//   - it is an exact prefix of the request (f_keep = 1) longer than the slot's lcp.
// Among qualifying entries the one with the longest lcp wins (ties: the shortest
// entry, i.e. the highest f_keep). Loading moves the entry into the slot (it leaves
// the cache; the slot saves its state again when released).
//
// Entry validation: an entry kept as cells of the cache (shared_store) records the
// generation of its sequence (detail::seq_fingerprint); once the cache changed those
// cells (a host seq_rm(-1, ...), seq_keep, clear, ...) the entry is dropped, counted in
// `invalidated`, and never served: by drop_invalid() (slot_manager calls it before every
// lookup) and by load().
//
// Allocation failure (std::bad_alloc; tests/fault_injection/fault_injection_prompt.cpp):
// every mutating operation (save, load, erase, evict_one, drop_invalid, clear,
// enforce_limits, set_limits, set_pinned) completes or leaves the cache (metadata,
// indexes, K/V bytes of every cell, block tables, refcounts), the store and the prompt
// cache (entries, ids, radix index, eviction order and stats, remembered evicted keys,
// counters) bit-identical. Each runs in two phases: first everything that allocates (new
// nodes and set elements preallocated as node handles, the store's save or load, the
// release of removed entries under the store's undo record: shared_store keeps a cache
// checkpoint and a copy of its free list, restored by noexcept swaps; copy_store and
// state_store release without throwing, in phase 2), then the removals and counters,
// which never allocate (radix_index::erase is noexcept). Cost: a shared_store operation
// journals the cell table's changes (cell_table::mark) and copies the layout's tables, if any. A custom store whose release() may throw and
// that has no undo record (detail::undoable_store) makes removals compound.
//
// Thread safety: not thread-safe. A prompt_cache, its store and the cache it works on are
// one unit: use them from one thread at a time (an external mutex around every call,
// const calls included, is enough). Distinct prompt_caches over distinct caches are
// independent.
#pragma once

#include <algorithm>      // std::max, std::find
#include <concepts>       // std::default_initializable
#include <deque>          // evicted keys, oldest first
#include <cstddef>        // std::size_t
#include <cstdint>        // fixed-width integers
#include <optional>       // lookup result
#include <set>            // eviction order
#include <span>           // labels
#include <string>         // messages, Prometheus text
#include <string_view>    // metric names
#include <map>            // entries by id (node handles: linked without allocating)
#include <type_traits>    // std::conditional_t
#include <variant>        // std::monostate
#include <utility>        // std::move
#include <vector>         // checkpoints, key scratch

#include "../error.hpp"
#include "../memory/memory.hpp"
#include "../reuse/eviction.hpp"
#include "entry_store.hpp"
#include "../tokens/prompt_tokens.hpp"
#include "radix_index.hpp"

KVCACHE_BEGIN_NAMESPACE

/// State of a sequence after processing positions up to pos_max: a sliding-window
/// sequence (F23) or a recurrent / hybrid memory's sequence (its recurrent state cannot be
/// rolled back, so prefix reuse resumes from such a checkpoint). Kept by the entry store
/// (state_store: the io::save_seq bytes of every part of the sequence).
template <class Handle>
struct swa_checkpoint {
    pos_t pos_min = 0;  ///< smallest position the saved state holds
    pos_t pos_max = 0;  ///< largest position the saved state holds
    Handle state;
};

/// Limits of the global prompt cache (llama-server's defaults: 8192 MiB, no token limit).
struct prompt_cache_limits {
    /// Byte limit; 0 = none. Always at least one entry is kept.
    std::size_t limit_bytes = std::size_t{8192} << 20;
    /// Token limit; 0 = none. With a byte limit the effective limit is dynamic:
    /// max(limit_tokens, limit_bytes / bytes per cached token).
    std::size_t limit_tokens = 0;
};

/// Why a request reused fewer tokens than it could have (slot_manager; at most one reason
/// per request, the first that applies in this order).
enum class miss_reason : std::uint8_t {
    none = 0,
    load_failed,  ///< the selected global entry could not be loaded (no room, store error)
    invalidated,  ///< a slot state or entry matching the request was dropped: its cells changed
    swa,          ///< the sliding window no longer held the prefix and no checkpoint covered it
    salt,         ///< another tenant's state matched more (never reused across salts)
    media,        ///< the reuse stopped at a media chunk (a different or partially matching one)
    evicted,      ///< an entry evicted earlier would have matched more
    /// a recurrent state (recurrent_memory, hybrid_memory) cannot be rolled back to the common
    /// prefix and no checkpoint at it was kept: resumed from the newest checkpoint below it,
    /// or recomputed from 0 (request_metrics::checkpoint_restored says which)
    no_checkpoint,
};
/// Number of miss_reason values (none included).
inline constexpr std::size_t n_miss_reasons = 8;
/// Stable name of a reason (Prometheus label value).
constexpr const char* to_string(miss_reason r) noexcept {
    switch (r) {
        case miss_reason::none: return "none";
        case miss_reason::load_failed: return "load_failed";
        case miss_reason::invalidated: return "invalidated";
        case miss_reason::swa: return "swa";
        case miss_reason::salt: return "salt";
        case miss_reason::media: return "media";
        case miss_reason::evicted: return "evicted";
        case miss_reason::no_checkpoint: return "no_checkpoint";
    }
    return "?";
}

/// Cumulative counters. The token counters mean what vLLM's prefix-cache metrics mean:
/// query_tokens = request tokens (vLLM prefix_cache_queries), hit_tokens = request tokens
/// whose K/V was reused, i.e. not computed (vLLM prefix_cache_hits); hit rate =
/// hit_tokens / query_tokens. Token and request counters are counted by slot_manager,
/// which knows what it reused (a prompt_cache alone leaves them 0); the entry counters by
/// the prompt_cache.
struct prefix_cache_metrics {
    // --- requests (slot_manager::prepare) ---
    std::uint64_t requests = 0;           ///< requests prepared
    std::uint64_t query_tokens = 0;       ///< request tokens of those requests
    std::uint64_t hit_tokens = 0;         ///< tokens reused = hit_tokens_slot + _global + _shifted + _tier
    std::uint64_t hit_tokens_slot = 0;    ///< exact-prefix tokens kept from the slot's own state
    std::uint64_t hit_tokens_global = 0;  ///< exact-prefix tokens kept from a global cache entry
    std::uint64_t hit_tokens_shifted = 0; ///< approximate hits: chunks moved into place (chunk_shift, F20)
    std::uint64_t hit_tokens_tier = 0;    ///< exact-prefix tokens loaded from a storage tier (slot_manager::attach_tiers)
    std::uint64_t tier_fetch_errors = 0;    ///< tier fetches in prepare that threw (std::bad_alloc); the request went on without
    std::uint64_t tier_publish_errors = 0;  ///< tier publishes in release that threw; the release completed
    std::uint64_t misses[n_miss_reasons] = {};  ///< requests per miss_reason (index: the enum value; [0] unused)
    std::uint64_t slot_states_invalidated = 0;  ///< slot states dropped because their cells changed
    std::uint64_t slot_states_evicted = 0;  ///< idle slot states dropped to make room for a request (blocks on paged)
    std::uint64_t room_refused = 0;         ///< requests that did not fit even with every idle state and entry evicted
    std::uint64_t checkpoints_saved = 0;     ///< checkpoints taken (slot_manager::save_checkpoint, F23 and recurrent)
    std::uint64_t checkpoints_dropped = 0;   ///< checkpoints dropped by a slot's max_checkpoints / max_checkpoint_bytes
    std::uint64_t checkpoints_restored = 0;  ///< requests that resumed from a checkpoint
    // --- global prompt cache entries ---
    std::uint64_t queries = 0;       ///< lookups of the global cache
    std::uint64_t hits = 0;          ///< entries loaded into a slot
    std::uint64_t load_failures = 0; ///< selected entries whose load failed (the entry is kept)
    std::uint64_t invalidated = 0;   ///< entries dropped because their cells changed (never served)
    std::uint64_t inserts = 0;       ///< entries stored
    std::uint64_t skipped = 0;       ///< saves skipped because an entry already contained the prompt
    std::uint64_t evictions = 0;     ///< entries evicted by the limits (or to make room in the store)
    std::uint64_t removed_prefixes = 0;  ///< entries dropped because a new entry extends them
    std::size_t bytes = 0;           ///< bytes held now
    std::size_t tokens = 0;          ///< tokens held now
    std::size_t entries = 0;         ///< entries held now
    /// Requests that missed for reason r.
    [[nodiscard]] std::uint64_t misses_for(miss_reason r) const noexcept { return misses[static_cast<std::size_t>(r)]; }
    /// hit_tokens / query_tokens (0 without queries).
    [[nodiscard]] double token_hit_rate() const noexcept {
        return query_tokens == 0 ? 0.0 : static_cast<double>(hit_tokens) / static_cast<double>(query_tokens);
    }
};

namespace detail {
inline void prom_escape(std::string& out, std::string_view v) {
    for (char ch : v) {
        if (ch == '\\') out += "\\\\";
        else if (ch == '"') out += "\\\"";
        else if (ch == '\n') out += "\\n";
        else out += ch;
    }
}
inline bool prom_name_ok(std::string_view n) noexcept {
    if (n.empty()) return false;
    for (std::size_t i = 0; i < n.size(); ++i) {
        const char c = n[i];
        const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
        if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
    }
    return true;
}
}  // namespace detail

/// One constant label of every rendered sample (name: [a-zA-Z_][a-zA-Z0-9_]*).
struct metric_label {
    std::string name;
    std::string value;
};

/// Renders the counters in the Prometheus text exposition format (version 0.0.4): per
/// metric a `# HELP` and a `# TYPE` line, then `name{labels} value` samples. Names start
/// with `prefix` ("kvcache" -> kvcache_prefix_cache_queries_total, ...); `labels` are added
/// to every sample (values escaped). Throws invalid_argument for a prefix or label name
/// that is not a valid Prometheus name. Counters end in _total; bytes/tokens/entries are gauges.
inline std::string to_prometheus(const prefix_cache_metrics& m, std::string_view prefix = "kvcache",
                                 std::span<const metric_label> labels = {}) {
    if (!detail::prom_name_ok(prefix))
        detail::fail(errc::invalid_argument, "to_prometheus: prefix = \"" + std::string(prefix) + "\" is not a metric name");
    std::string base;  // constant labels, without braces
    for (const metric_label& l : labels) {
        if (!detail::prom_name_ok(l.name) || l.name.starts_with("__"))
            detail::fail(errc::invalid_argument, "to_prometheus: label name \"" + l.name + "\" is not valid");
        if (!base.empty()) base += ',';
        base += l.name;
        base += "=\"";
        detail::prom_escape(base, l.value);
        base += '"';
    }
    std::string out;
    auto head = [&](std::string_view name, std::string_view type, std::string_view help) {
        out += "# HELP ";
        out += prefix;
        out += '_';
        out += name;
        out += ' ';
        out += help;
        out += "\n# TYPE ";
        out += prefix;
        out += '_';
        out += name;
        out += ' ';
        out += type;
        out += '\n';
    };
    auto sample = [&](std::string_view name, std::string_view label, std::uint64_t v) {
        out += prefix;
        out += '_';
        out += name;
        if (!base.empty() || !label.empty()) {
            out += '{';
            out += base;
            if (!base.empty() && !label.empty()) out += ',';
            out += label;
            out += '}';
        }
        out += ' ';
        out += std::to_string(v);
        out += '\n';
    };
    auto one = [&](std::string_view name, std::string_view type, std::string_view help, std::uint64_t v) {
        head(name, type, help);
        sample(name, {}, v);
    };
    one("requests_total", "counter", "Requests prepared by the slot manager.", m.requests);
    one("prefix_cache_queries_total", "counter", "Request tokens queried against the prefix cache (vLLM prefix_cache_queries).",
        m.query_tokens);
    head("prefix_cache_hits_total", "counter",
         "Request tokens reused instead of computed (vLLM prefix_cache_hits), by source: exact prefix kept from the "
         "slot, exact prefix from a global cache entry, approximate (chunk-shifted), exact prefix from a storage tier.");
    sample("prefix_cache_hits_total", "source=\"slot\"", m.hit_tokens_slot);
    sample("prefix_cache_hits_total", "source=\"global\"", m.hit_tokens_global);
    sample("prefix_cache_hits_total", "source=\"shifted\"", m.hit_tokens_shifted);
    sample("prefix_cache_hits_total", "source=\"tier\"", m.hit_tokens_tier);
    head("prefix_cache_misses_total", "counter", "Requests that reused less than they could have, by reason.");
    for (std::size_t r = 1; r < n_miss_reasons; ++r)
        sample("prefix_cache_misses_total", std::string("reason=\"") + to_string(static_cast<miss_reason>(r)) + '"',
               m.misses[r]);
    one("slot_states_invalidated_total", "counter", "Slot states dropped because their cells changed.",
        m.slot_states_invalidated);
    one("slot_states_evicted_total", "counter", "Idle slot states dropped to make room for a request.",
        m.slot_states_evicted);
    one("prefix_cache_room_refused_total", "counter",
        "Requests that did not fit even with every idle slot state and prompt cache entry evicted.", m.room_refused);
    one("prefix_cache_checkpoints_saved_total", "counter", "Checkpoints taken (sliding-window or recurrent state).",
        m.checkpoints_saved);
    one("prefix_cache_checkpoints_dropped_total", "counter",
        "Checkpoints dropped by the per-slot number or byte limit, oldest first.", m.checkpoints_dropped);
    one("prefix_cache_checkpoints_restored_total", "counter", "Requests that resumed from a checkpoint.",
        m.checkpoints_restored);
    head("prefix_cache_tier_errors_total", "counter",
         "Storage-tier calls of the slot manager that threw (fetch in prepare, publish in release); the request went on.");
    sample("prefix_cache_tier_errors_total", "op=\"fetch\"", m.tier_fetch_errors);
    sample("prefix_cache_tier_errors_total", "op=\"publish\"", m.tier_publish_errors);
    one("prompt_cache_lookups_total", "counter", "Lookups of the global prompt cache.", m.queries);
    one("prompt_cache_loads_total", "counter", "Global prompt cache entries loaded into a slot.", m.hits);
    one("prompt_cache_load_failures_total", "counter", "Selected entries whose load failed.", m.load_failures);
    one("prompt_cache_invalidated_total", "counter", "Entries dropped because their cells changed.", m.invalidated);
    one("prompt_cache_inserts_total", "counter", "Entries stored.", m.inserts);
    one("prompt_cache_skipped_total", "counter", "Saves skipped: an entry already contained the prompt.", m.skipped);
    one("prompt_cache_evictions_total", "counter", "Entries evicted by the limits or to make room.", m.evictions);
    one("prompt_cache_removed_prefixes_total", "counter", "Entries dropped because a new entry extends them.",
        m.removed_prefixes);
    one("prompt_cache_bytes", "gauge", "Bytes held by the global prompt cache.", m.bytes);
    one("prompt_cache_tokens", "gauge", "Tokens held by the global prompt cache.", m.tokens);
    one("prompt_cache_entries", "gauge", "Entries held by the global prompt cache.", m.entries);
    return out;
}

/// Options of one saved entry.
struct entry_options {
    std::uint64_t salt = 0;     ///< tenant namespace: part of the key, lookups never cross it
    std::int32_t priority = 0;  ///< used by reuse::evict_priority (larger = kept longer)
    bool pinned = false;        ///< never evicted by the limits
    std::uint64_t hits = 0;     ///< hits carried over from an earlier life of the entry (reuse::evict_lfu)
};

/// The global prompt cache for cache type Cache. Store keeps the K/V state
/// (copy_store, state_store or shared_store), Eviction orders evictions (reuse::evict_lru, ...).
/// Thread safety: not thread-safe, find() included (it counts); only const calls (select,
/// metrics, tokens_of, ...) may run concurrently with each other.
template <class Cache, class Store = copy_store<Cache>, class Eviction = reuse::evict_lru>
class prompt_cache {
    static_assert(memory<Cache>, "kvcache: prompt_cache<Cache> needs a kvcache::memory (see kvcache/memory/memory.hpp)");
    static_assert(entry_store<Store, Cache>,
                  "kvcache: Store does not satisfy kvcache::entry_store (see kvcache/prompt/entry_store.hpp)");
    static_assert(eviction_policy<Eviction>,
                  "kvcache: Eviction does not satisfy kvcache::eviction_policy (see kvcache/reuse/eviction.hpp)");

public:
    using store_type = Store;
    using handle = typename Store::handle;
    using checkpoint = swa_checkpoint<handle>;
    using entry_id = radix_index::entry_id;
    /// Minimum f_keep of a selected entry (llama-server's 0.25).
    static constexpr double min_f_keep = 0.25;

    /// What a lookup selected.
    struct selection {
        entry_id id = 0;
        std::uint32_t lcp = 0;  ///< exact common prefix with the request
        std::uint32_t len = 0;  ///< entry length
    };
    /// An entry moved out of the cache into a sequence.
    struct loaded {
        prompt_tokens tokens;
        std::vector<checkpoint> checkpoints;
        std::uint64_t hits = 0;  ///< hits of the entry so far, this one included (pass back in entry_options)
    };

    /// Two constructors rather than a default Store argument: a store that cannot be default
    /// constructed (shared_store) must not make std::is_constructible<prompt_cache> ill-formed.
    explicit prompt_cache(prompt_cache_limits limits = {})
        requires std::default_initializable<Store>
        : limits_(limits), store_() {}
    explicit prompt_cache(prompt_cache_limits limits, Store store) : limits_(limits), store_(std::move(store)) {}
    prompt_cache(const prompt_cache&) = delete;
    prompt_cache& operator=(const prompt_cache&) = delete;

    [[nodiscard]] const prompt_cache_limits& limits() const noexcept { return limits_; }
    /// Changes the limits and evicts what no longer fits. Strong under std::bad_alloc (the
    /// old limits stay).
    void set_limits(Cache& cache, prompt_cache_limits limits) {
        const prompt_cache_limits old = limits_;
        limits_ = limits;
        try {
            enforce_limits(cache);
        } catch (...) {
            limits_ = old;
            throw;
        }
    }
    [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }
    [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
    [[nodiscard]] std::size_t n_tokens() const noexcept { return tokens_; }
    [[nodiscard]] prefix_cache_metrics metrics() const noexcept {
        prefix_cache_metrics m = metrics_;
        m.bytes = bytes_;
        m.tokens = tokens_;
        m.entries = entries_.size();
        return m;
    }
    [[nodiscard]] Store& store() noexcept { return store_; }
    [[nodiscard]] const radix_index& index() const noexcept { return index_; }

    /// Tokens of a stored entry (nullptr if the id is unknown).
    [[nodiscard]] const prompt_tokens* tokens_of(entry_id id) const noexcept {
        const auto it = entries_.find(id);
        return it == entries_.end() ? nullptr : &it->second.tokens;
    }
    /// Ids of every entry (any order).
    [[nodiscard]] std::vector<entry_id> ids() const {
        std::vector<entry_id> out;
        out.reserve(entries_.size());
        for (const auto& [id, e] : entries_) out.push_back(id);
        return out;
    }

    /// Unpinned entries in eviction order (the first is evicted next).
    [[nodiscard]] std::vector<entry_id> eviction_order() const {
        std::vector<entry_id> out;
        out.reserve(order_.size());
        for (const auto& o : order_) out.push_back(o.second);
        return out;
    }
    /// The positions [pos_min, pos_max] each checkpoint of entry id holds, oldest first
    /// (empty if the id is unknown).
    [[nodiscard]] std::vector<std::pair<pos_t, pos_t>> checkpoint_spans_of(entry_id id) const {
        std::vector<std::pair<pos_t, pos_t>> out;
        if (const auto it = entries_.find(id); it != entries_.end())
            for (const checkpoint& ck : it->second.checkpoints) out.emplace_back(ck.pos_min, ck.pos_max);
        return out;
    }
    /// What the eviction policy knows of entry id (nullptr if the id is unknown).
    [[nodiscard]] const entry_stats* stats_of(entry_id id) const noexcept {
        const auto it = entries_.find(id);
        return it == entries_.end() ? nullptr : &it->second.stats;
    }
    /// Calls f(salt, key) for every remembered key of an evicted entry (evicted_lcp), oldest first.
    template <class F>
    void for_each_evicted(F&& f) const {
        for (const auto& [salt, key] : ghost_order_) f(salt, std::span<const key_symbol>(key));
    }
    /// The radix index of the remembered evicted keys (ids unused).
    [[nodiscard]] const radix_index& evicted_index() const noexcept { return ghost_; }

    /// Saves the state of sequence seq, which holds `tokens`, as a new entry (llama-server's
    /// prompt_save). Skipped (returns nullopt) if tokens is empty or an entry of the same
    /// tenant already starts with tokens; entries that are prefixes of tokens are dropped
    /// (unless pinned). Then the limits are enforced; when they evict the new entry itself
    /// (e.g. LFU: a new entry has no hits) nullopt is returned, never the id of a removed
    /// entry. Checkpoints move into the entry (released when nothing is stored). Throws
    /// invalid_argument when seq does not hold `tokens`: its last position must be
    /// tokens.size() - 1 (a 12-token key for a sequence holding positions 0..4 is refused);
    /// transaction_open while placements are staged. Both throw before anything changes
    /// (the checkpoints are released).
    /// Strong under std::bad_alloc: runs in two phases, everything that allocates first
    /// (the new entry, its index node, the remembered keys of evicted entries, the store's
    /// save and the release of replaced and evicted entries under the store's undo record),
    /// then the removals and counters without allocating. A throw leaves the cache, the
    /// store and the prompt cache bit-identical (checkpoints passed in are then destroyed,
    /// not released).
    std::optional<entry_id> save(Cache& cache, seq_id_t seq, const prompt_tokens& tokens,
                                 const entry_options& opt = {}, std::vector<checkpoint> checkpoints = {}) {
        if (cache.in_transaction()) {
            release_all(cache, checkpoints);
            detail::fail(errc::transaction_open, "prompt_cache::save: placements are staged; commit() or restore() first");
        }
        KVCACHE_ASSERT(!batch_);  // (slot_manager::prepare never saves)
        if (!tokens.empty() && cache.seq_pos_max(seq) != static_cast<pos_t>(tokens.size()) - 1) {
            const pos_t got = cache.seq_pos_max(seq);
            release_all(cache, checkpoints);
            detail::fail(errc::invalid_argument,
                         "prompt_cache::save: the key has " + std::to_string(tokens.size()) + " tokens but sequence " +
                             std::to_string(seq) + (got < 0 ? std::string(" is empty") : " ends at position " + std::to_string(got)) +
                             "; the key must be exactly what the sequence holds");
        }
        if (tokens.empty()) {
            release_all(cache, checkpoints);
            return std::nullopt;
        }
        key_symbols(tokens, key_);
        if (index_.has_extension(opt.salt, key_)) {
            const std::optional<entry_id> ext = extension_of(opt.salt);
            if (!checkpoints.empty()) {
                two_phase(cache, 0, [&](removal&) { release_phase1(cache, checkpoints); });
                release_phase2(cache, checkpoints);
            }
            if (ext) update_stats(*ext, [&](entry_stats& s) { s.last_use = ++clock_; });
            ++metrics_.skipped;
            return std::nullopt;
        }
        // Phase 1: allocate and prepare; the store's changes are undone on a throw.
        removal r;
        std::vector<entry_id> prefixes;
        for (const auto& [id, len] : index_.prefixes_of(opt.salt, key_))
            if (!entries_.at(id).pinned) prefixes.push_back(id);
        const std::size_t n_prefixes = prefixes.size();
        const entry_id id = next_id_;
        const std::uint64_t now = clock_ + 1;
        entry_map tmp;
        tmp.emplace(id, entry{tokens, opt.salt, handle{}, {}, 0, {now, opt.hits, opt.priority}, opt.pinned, {}, tokens.size()});
        typename entry_map::node_type fresh = tmp.extract(tmp.begin());
        typename order_set::node_type fresh_rank;
        if (!opt.pinned) {
            order_set o;
            o.emplace(Eviction::rank(fresh.mapped().stats), id);
            fresh_rank = o.extract(o.begin());
        }
        r.ids.reserve(entries_.size() + 1);  // every entry at most: doom() cannot fail on it
        undo u(store_, cache);
        bool linked = false;  // the new entry is in entries_, order_ and the index
        try {
            for (const entry_id victim : prefixes) doom(cache, r, victim, false);
            result<handle> h = store_.save(cache, seq);
            while (!h && h.code() == errc::no_space) {  // the store is full: evict and retry
                const auto victim = next_victim(r);
                if (!victim) break;
                doom(cache, r, *victim, true);
                h = store_.save(cache, seq);
            }
            if (!h) {  // nothing stored: the replaced and evicted entries stay removed
                release_phase1(cache, checkpoints);
                commit(cache, r, n_prefixes);
                release_phase2(cache, checkpoints);
                return std::nullopt;
            }
            entry& e = fresh.mapped();
            e.state = std::move(h).value();
            e.checkpoints = std::move(checkpoints);
            e.bytes = store_.bytes(cache, e.state);
            for (const auto& ck : e.checkpoints) e.bytes += store_.bytes(cache, ck.state);
            const bool inserted = index_.insert(opt.salt, key_, id, &e.where);
            KVCACHE_ASSERT(inserted);
            static_cast<void>(inserted);
            // Linking moves node handles: no allocation.
            bytes_ += e.bytes;
            tokens_ += e.n_tokens;
            entries_.insert(std::move(fresh));
            if (!fresh_rank.empty()) order_.insert(std::move(fresh_rank));
            linked = true;
            plan_limits(cache, r);
        } catch (...) {
            if (linked) unlink_new(id);
            else if (!fresh.empty() && fresh.mapped().where.valid()) index_.erase(fresh.mapped().where);
            u.rollback(cache, *this, r);
            throw;
        }
        // Phase 2: nothing below allocates.
        next_id_ = id + 1;
        clock_ = now;
        ++metrics_.inserts;
        const bool self_evicted = r.contains(id);
        commit(cache, r, n_prefixes);
        if (self_evicted) return std::nullopt;  // its own limits evicted it
        return id;
    }

    /// Selects the entry for `request` (tenant salt) given the requesting slot's own state:
    /// slot_lcp = common prefix of the slot's tokens and the request, slot_len = slot's size.
    /// O(request length) through the radix index. Counts a query (`queries`); the hit is
    /// counted by a successful load(). Does not check entries against the cache: call
    /// drop_invalid(cache) first (slot_manager does).
    [[nodiscard]] std::optional<selection> find(const prompt_tokens& request, std::uint64_t salt = 0,
                                                std::size_t slot_lcp = 0, std::size_t slot_len = 0) {
        ++metrics_.queries;
        return select(request, salt, slot_lcp, slot_len);
    }

    /// Whether entry id (and its checkpoints) still relies on unchanged cells; false for an
    /// unknown id. Always true with a store without valid() (copy_store, state_store).
    [[nodiscard]] bool valid(const Cache& cache, entry_id id) const {
        const auto it = entries_.find(id);
        return it != entries_.end() && !it->second.doomed && entry_valid(cache, it->second);
    }
    /// What drop_invalid removed.
    struct dropped {
        std::size_t n = 0;        ///< entries dropped
        std::size_t max_lcp = 0;  ///< longest common prefix of a dropped entry with the request passed
    };
    /// Drops every entry whose cells changed under it (counted in `invalidated`). With a
    /// request, also reports the longest prefix of it a dropped entry of tenant `salt` held
    /// (miss reason `invalidated`). O(entries) with a store that checks entries
    /// (shared_store), else O(1).
    dropped drop_invalid(Cache& cache, const prompt_tokens* request = nullptr, std::uint64_t salt = 0) {
        dropped out;
        if constexpr (detail::checks_entries<Store, Cache>) {
            std::vector<entry_id> bad;
            for (const auto& [id, e] : entries_)
                if (!e.doomed && !entry_valid(cache, e)) {
                    bad.push_back(id);
                    if (request != nullptr && e.salt == salt)
                        out.max_lcp = std::max(out.max_lcp, e.tokens.common_prefix(*request));
                }
            if (!bad.empty()) remove(cache, bad, false);
            metrics_.invalidated += bad.size();
            out.n = bad.size();
        } else {
            static_cast<void>(cache);
            static_cast<void>(request);
            static_cast<void>(salt);
        }
        return out;
    }

    /// Longest common prefix of `request` with an entry of the same tenant evicted earlier
    /// (the keys of the most recent evictions are remembered, up to evicted_memory symbols):
    /// how much the request could have reused had those entries stayed (miss reason `evicted`).
    [[nodiscard]] std::size_t evicted_lcp(const prompt_tokens& request, std::uint64_t salt = 0) const {
        if (ghost_.size() == 0 || request.empty()) return 0;
        std::vector<key_symbol> key;
        key_symbols(request, key);
        std::size_t best = 0;
        ghost_.candidates(salt, key, [&](const radix_index::candidate& c) {
            best = c.lcp;
            return false;
        });
        return best;
    }
    /// Symbols of evicted keys remembered for evicted_lcp.
    static constexpr std::size_t evicted_memory = std::size_t{1} << 18;

    /// The same selection without counting (for tests and tools).
    [[nodiscard]] std::optional<selection> select(const prompt_tokens& request, std::uint64_t salt = 0,
                                                  std::size_t slot_lcp = 0, std::size_t slot_len = 0) const {
        if (request.empty() || entries_.empty()) return std::nullopt;
        std::vector<key_symbol> key;
        key_symbols(request, key);
        const double n_req = static_cast<double>(request.size());
        const double fk_slot = slot_len == 0 ? 0.0 : static_cast<double>(slot_lcp) / static_cast<double>(slot_len);
        const double sim_slot = static_cast<double>(slot_lcp) / n_req;
        std::optional<selection> best;
        index_.candidates(salt, key, [&](const radix_index::candidate& c) {
            // The index compares hashed media symbols; confirm with the exact comparison.
            const entry& e = entries_.at(c.id);
            if (e.doomed) return true;
            const auto lcp = static_cast<std::uint32_t>(e.tokens.common_prefix(request));
            if (qualifies(lcp, c.len, n_req, fk_slot, sim_slot, slot_lcp)) {
                best = selection{c.id, lcp, c.len};
                return false;
            }
            return true;
        });
        return best;
    }

    /// The selection computed the way llama-server does it: a linear scan of every entry
    /// (same qualification rule, same winner). For benchmarks and cross-checks.
    [[nodiscard]] std::optional<selection> select_linear(const prompt_tokens& request, std::uint64_t salt = 0,
                                                         std::size_t slot_lcp = 0, std::size_t slot_len = 0) const {
        if (request.empty()) return std::nullopt;
        const double n_req = static_cast<double>(request.size());
        const double fk_slot = slot_len == 0 ? 0.0 : static_cast<double>(slot_lcp) / static_cast<double>(slot_len);
        const double sim_slot = static_cast<double>(slot_lcp) / n_req;
        std::optional<selection> best;
        for (const auto& [id, e] : entries_) {
            if (e.salt != salt) continue;
            const auto lcp = static_cast<std::uint32_t>(e.tokens.common_prefix(request));
            const auto len = static_cast<std::uint32_t>(e.tokens.size());
            if (!qualifies(lcp, len, n_req, fk_slot, sim_slot, slot_lcp)) continue;
            if (!best || lcp > best->lcp || (lcp == best->lcp && len < best->len)) best = selection{id, lcp, len};
        }
        return best;
    }

    /// Moves entry id into the empty sequence dst (its K/V through the store) and removes it
    /// from the cache; counts a hit. On error (unknown id, dst not empty, no space) nothing
    /// changes and `load_failures` counts it; an entry whose cells changed under it is
    /// dropped instead (invalid_cell result, counted in `invalidated`). Throws
    /// transaction_open while placements are staged: the host's staged placements are
    /// never committed by a load. Strong under std::bad_alloc (the store's load is; the
    /// entry's release runs under the store's undo record).
    result<loaded> load(Cache& cache, seq_id_t dst, entry_id id) {
        if (cache.in_transaction())
            detail::fail(errc::transaction_open, "prompt_cache::load: placements are staged; commit() or restore() first");
        const auto it = entries_.find(id);
        if (it == entries_.end() || it->second.doomed)
            return detail::make_error(errc::invalid_argument, "prompt_cache::load: no entry with id " + std::to_string(id));
        if (!entry_valid(cache, it->second)) {
            result<loaded> err = detail::make_error(errc::invalid_cell, "prompt_cache::load: entry " + std::to_string(id) +
                                                                            " was invalidated: the cache changed its cells");
            const entry_id bad[] = {id};
            remove(cache, bad, false);
            ++metrics_.invalidated;
            return err;
        }
        removal r;
        r.ids.reserve(1);
        undo u(store_, cache);
        loaded out;
        try {
            result<void> got = store_.load(cache, dst, it->second.state);
            if (!got) {
                result<loaded> err = detail::make_error(got.code(), got.message());  // (allocates: before the count)
                ++metrics_.load_failures;
                return err;
            }
            doom(cache, r, id, false, false);  // the checkpoints move to the caller
            if (batch_) out.tokens = it->second.tokens;  // a rolled-back batch keeps the entry whole
        } catch (...) {
            u.rollback(cache, *this, r);
            throw;
        }
        ++metrics_.hits;
        entry& e = it->second;
        out.hits = e.stats.hits + 1;
        if (batch_) {  // the checkpoints are lent: give_back() returns them on a rollback
            out.checkpoints = std::move(e.checkpoints);
            batch_->loaded.push_back(id);  // within the reserved room
            defer(r);
            return out;
        }
        out.tokens = std::move(e.tokens);
        out.checkpoints = std::move(e.checkpoints);
        commit(cache, r, 0);
        return out;
    }

    /// Removes entry id (its state is released); returns false if unknown. Strong under
    /// std::bad_alloc.
    bool erase(Cache& cache, entry_id id) {
        if (!entries_.contains(id)) return false;
        const entry_id one[] = {id};
        remove(cache, one, false);
        return true;
    }

    /// Pins (never evicted) or unpins an entry (then enforces the limits); returns false if
    /// unknown. Strong under std::bad_alloc.
    bool set_pinned(Cache& cache, entry_id id, bool pinned) {
        const auto it = entries_.find(id);
        if (it == entries_.end()) return false;
        if (it->second.pinned == pinned) return true;
        if (pinned) {
            order_.erase({Eviction::rank(it->second.stats), id});
            it->second.pinned = true;
            return true;  // pinning evicts nothing
        }
        order_set o;
        o.emplace(Eviction::rank(it->second.stats), id);
        order_.insert(o.extract(o.begin()));
        it->second.pinned = false;
        try {
            enforce_limits(cache);
        } catch (...) {
            order_.erase({Eviction::rank(it->second.stats), id});
            it->second.pinned = true;
            throw;
        }
        return true;
    }
    /// Sets an entry's priority (reuse::evict_priority); returns false if unknown. Never allocates.
    bool set_priority(entry_id id, std::int32_t priority) noexcept {
        return update_stats(id, [&](entry_stats& s) { s.priority = priority; });
    }

    /// Removes every entry. Strong under std::bad_alloc.
    void clear(Cache& cache) {
        const std::vector<entry_id> all = ids();
        remove(cache, all, false);
    }

    /// Evicts entries in eviction order while a limit is exceeded, keeping at least one
    /// entry (llama-server's update()). Pinned entries are never evicted. Strong under
    /// std::bad_alloc.
    void enforce_limits(Cache& cache) {
        if (!exceeds_limits()) return;  // (no undo record to take)
        two_phase(cache, entries_.size(), [&](removal& r) { plan_limits(cache, r); });
    }

    /// Calls f(handle) for the store handle of every entry eviction may remove (every
    /// unpinned entry: its state and its checkpoints), in eviction order.
    template <class F>
    void for_each_evictable_handle(F&& f) const {
        for (const auto& o : order_) {
            const entry& e = entries_.at(o.second);
            if (e.doomed) continue;
            f(e.state);
            for (const checkpoint& ck : e.checkpoints) f(ck.state);
        }
    }

    /// Evicts the first entry in eviction order (its key is remembered for evicted_lcp);
    /// false if every entry is pinned (or none). Strong under std::bad_alloc.
    bool evict_one(Cache& cache) {
        const std::optional<entry_id> victim = next_victim(removal{});
        if (!victim) return false;
        two_phase(cache, 1, [&](removal& r) { doom(cache, r, *victim, true); });
        return true;
    }

    /// Batch (slot_manager::prepare's undo; library components only): from begin_batch on,
    /// the removals of drop_invalid, load, erase, evict_one and enforce_limits take effect
    /// for every later call (the entries are no longer found, loaded or evicted; the store
    /// released their cells) but stay recorded until commit_batch drops them, or
    /// rollback_batch puts everything back as it was at begin_batch: entries, index,
    /// eviction order, remembered keys, counters, the store and its cells (with an
    /// undoable store; the caller restores the cache otherwise). load() hands out copies
    /// of the entry's tokens and lends its checkpoints (moved out; give_back() returns
    /// them before a rollback). save() is refused during a batch.
    /// begin_batch may throw std::bad_alloc (nothing changed).
    void begin_batch(Cache& cache, detail::internal_access) {
        KVCACHE_ASSERT(!batch_);
        batch_state b(store_, cache);
        b.r.ids.reserve(entries_.size());  // every removal of the batch fits: no entry is added
        b.loaded.reserve(entries_.size());
        b.metrics = metrics_;
        batch_.emplace(std::move(b));
    }
    /// Whether a batch is open.
    [[nodiscard]] bool in_batch() const noexcept { return batch_.has_value(); }
    /// Drops the batch's removed entries for good (never throws).
    void commit_batch(Cache& cache, detail::internal_access) noexcept {
        if (!batch_) return;
        for (const entry_id id : batch_->loaded) entries_.find(id)->second.checkpoints.clear();  // the caller's now
        commit(cache, batch_->r, 0);
        batch_.reset();
    }
    /// Returns the checkpoints a load of the open batch lent, whole and in order (before
    /// rollback_batch). Never throws.
    void give_back(entry_id id, std::vector<checkpoint>&& cks, detail::internal_access) noexcept {
        entries_.find(id)->second.checkpoints = std::move(cks);
    }
    /// Puts everything back as it was at begin_batch (never throws).
    void rollback_batch(Cache& cache, detail::internal_access) noexcept {
        if (!batch_) return;
        for (const entry_id id : batch_->r.ids) entries_.find(id)->second.doomed = false;
        batch_->u.rollback(cache, *this, batch_->r);
        metrics_ = batch_->metrics;
        batch_.reset();
    }

private:
    struct entry {
        prompt_tokens tokens;
        std::uint64_t salt = 0;
        handle state;
        std::vector<checkpoint> checkpoints;
        std::size_t bytes = 0;  // store bytes of state + checkpoints
        entry_stats stats;
        bool pinned = false;
        radix_index::position where;  // its node in index_
        std::size_t n_tokens = 0;     // tokens.size() (load() moves the tokens out before the totals drop it)
        bool doomed = false;          // removed by the open batch (begin_batch), committed by commit_batch
    };
    using entry_map = std::map<entry_id, entry>;
    using order_set = std::set<std::pair<eviction_rank, entry_id>>;

    /// The stores that undo their own changes (shared_store: a cache checkpoint and a copy of
    /// its free list) release entries in phase 1, on copies of the handles; the others
    /// release in phase 2 when release() cannot throw (copy_store, state_store), else in
    /// phase 1 for good (a custom store with a throwing release: not strong).
    static constexpr bool undoable = detail::undoable_store<Store, Cache>;
    static constexpr bool late_release =
        !undoable && noexcept(std::declval<Store&>().release(std::declval<Cache&>(), std::declval<handle&>()));

    /// What one operation removes, collected in phase 1 and done in commit().
    struct removal {
        std::vector<entry_id> ids;    // entries to drop (evicted ones last)
        std::size_t n_evicted = 0;    // ids counted as evictions
        std::size_t n_ghost = 0;      // keys pushed to the evicted-key memory (undone on a throw)
        std::size_t bytes = 0;        // totals of ids
        std::size_t tokens = 0;
        [[nodiscard]] bool contains(entry_id id) const noexcept {
            return std::find(ids.begin(), ids.end(), id) != ids.end();
        }
    };

    /// The store's undo record for one operation (empty unless the store is undoable).
    struct undo {
        [[no_unique_address]] typename detail::undo_record_or<Store, undoable>::type rec{};
        undo(Store& store, Cache& cache) {
            if constexpr (undoable) store.save_undo(cache, rec);
            static_cast<void>(store);
            static_cast<void>(cache);
        }
        /// Puts back what phase 1 changed: the store and the cache, the evicted-key memory.
        void rollback(Cache& cache, prompt_cache& pc, removal& r) noexcept {
            pc.unpush_ghosts(r);
            if constexpr (undoable) pc.store_.load_undo(cache, rec);
            static_cast<void>(cache);
        }
    };

    /// Phase 1 of releasing handles: undoable stores release copies (the record undoes it),
    /// stores whose release may throw release for good.
    void release_phase1(Cache& cache, const entry& e, bool with_checkpoints) {
        if constexpr (!late_release) {
            release_phase1(cache, e.state);
            if (with_checkpoints)
                for (const auto& ck : e.checkpoints) release_phase1(cache, ck.state);
        }
        static_cast<void>(cache);
        static_cast<void>(e);
        static_cast<void>(with_checkpoints);
    }
    void release_phase1(Cache& cache, std::vector<checkpoint>& cks) {
        if constexpr (undoable) {
            for (const auto& ck : cks) release_phase1(cache, ck.state);
        } else if constexpr (!late_release) {
            release_all(cache, cks);
        }
        static_cast<void>(cache);
        static_cast<void>(cks);
    }
    void release_phase1(Cache& cache, const handle& h) {
        if constexpr (undoable) {
            static_assert(std::is_copy_constructible_v<handle>, "kvcache: an undoable store needs copyable handles");
            handle copy = h;
            store_.release(cache, copy);
        } else if constexpr (!late_release) {
            store_.release(cache, const_cast<handle&>(h));  // released for good (see late_release)
        }
    }
    /// Phase 2: stores that release late release now (never throws).
    void release_phase2(Cache& cache, std::vector<checkpoint>& cks) noexcept {
        if constexpr (late_release)
            for (auto& ck : cks) store_.release(cache, ck.state);
        cks.clear();
        static_cast<void>(cache);
    }

    /// Phase 1 of removing entry id (r.ids has room for it): remembers its key when
    /// evicted, releases its state and checkpoints (see release_phase1).
    void doom(Cache& cache, removal& r, entry_id id, bool evicted, bool with_checkpoints = true) {
        const entry& e = entries_.at(id);
        if (evicted) push_ghost(r, e);
        release_phase1(cache, e, with_checkpoints);
        r.ids.push_back(id);  // within the reserved room
        r.bytes += e.bytes;
        r.tokens += e.n_tokens;
        if (evicted) ++r.n_evicted;
    }

    /// The first unpinned entry in eviction order not yet in r.
    std::optional<entry_id> next_victim(const removal& r) const noexcept {
        for (const auto& o : order_)
            if (!r.contains(o.second) && !entries_.find(o.second)->second.doomed) return o.second;
        return std::nullopt;
    }

    /// Whether a limit is exceeded (enforce_limits would evict, unless every entry is pinned).
    [[nodiscard]] bool exceeds_limits() const noexcept {
        if (entries_.size() <= 1) return false;
        if (limits_.limit_bytes > 0 && bytes_ > limits_.limit_bytes) return true;
        if (limits_.limit_tokens > 0) {
            const double per_token = std::max(1.0, static_cast<double>(bytes_) / static_cast<double>(std::max<std::size_t>(1, tokens_)));
            const std::size_t limit_now =
                limits_.limit_bytes > 0
                    ? std::max(limits_.limit_tokens, static_cast<std::size_t>(static_cast<double>(limits_.limit_bytes) / per_token))
                    : limits_.limit_tokens;
            return tokens_ > limit_now;
        }
        return false;
    }

    /// Phase 1 of enforce_limits: dooms entries in eviction order while a limit is exceeded
    /// by what remains once r's entries are gone, keeping at least one entry.
    void plan_limits(Cache& cache, removal& r) {
        auto left = [&] { return entries_.size() - r.ids.size(); };
        if (limits_.limit_bytes > 0)
            while (left() > 1 && bytes_ - r.bytes > limits_.limit_bytes) {
                const auto victim = next_victim(r);
                if (!victim) break;
                doom(cache, r, *victim, true);
            }
        if (limits_.limit_tokens > 0) {
            const std::size_t b = bytes_ - r.bytes, t = tokens_ - r.tokens;
            const double per_token = std::max(1.0, static_cast<double>(b) / static_cast<double>(std::max<std::size_t>(1, t)));
            const std::size_t limit_now =
                limits_.limit_bytes > 0
                    ? std::max(limits_.limit_tokens, static_cast<std::size_t>(static_cast<double>(limits_.limit_bytes) / per_token))
                    : limits_.limit_tokens;
            while (left() > 1 && tokens_ - r.tokens > limit_now) {
                const auto victim = next_victim(r);
                if (!victim) break;
                doom(cache, r, *victim, true);
            }
        }
    }

    /// Phase 2: drops r's entries (index, eviction order, totals, late releases) and counts
    /// them; the first n_prefixes as removed prefixes, the evicted ones as evictions.
    void commit(Cache& cache, removal& r, std::size_t n_prefixes) noexcept {
        for (const entry_id id : r.ids) {
            const auto it = entries_.find(id);
            entry& e = it->second;
            detach(id, e);
            if constexpr (late_release) {
                store_.release(cache, e.state);
                for (auto& ck : e.checkpoints) store_.release(cache, ck.state);
            }
            entries_.erase(it);
        }
        metrics_.removed_prefixes += n_prefixes;
        metrics_.evictions += r.n_evicted;
        trim_ghosts();
        static_cast<void>(cache);
    }

    /// Removes the entries ids (every one known) with the strong guarantee.
    void remove(Cache& cache, std::span<const entry_id> ids, bool evicted) {
        two_phase(cache, ids.size(), [&](removal& r) {
            for (const entry_id id : ids) doom(cache, r, id, evicted);
        });
    }

    /// Runs phase1(r) (r has room for `room` ids) under the store's undo record, a throw
    /// putting everything back, then commits r.
    template <class F>
    void two_phase(Cache& cache, std::size_t room, F&& phase1) {
        removal r;
        r.ids.reserve(room);
        undo u(store_, cache);
        try {
            phase1(r);
        } catch (...) {
            u.rollback(cache, *this, r);
            throw;
        }
        if (batch_)
            defer(r);
        else
            commit(cache, r, 0);
    }

    /// The open batch: what its operations removed, the store's record at its start, the counters.
    struct batch_state {
        removal r;
        undo u;
        prefix_cache_metrics metrics;
        std::vector<entry_id> loaded;  // entries load() lent their checkpoints to the caller
        batch_state(Store& store, Cache& cache) : u(store, cache) {}
    };
    /// Adds r's removals to the open batch (never allocates: its room was reserved).
    void defer(removal& r) noexcept {
        for (const entry_id id : r.ids) {
            entries_.find(id)->second.doomed = true;
            batch_->r.ids.push_back(id);
        }
        batch_->r.n_evicted += r.n_evicted;
        batch_->r.n_ghost += r.n_ghost;
        batch_->r.bytes += r.bytes;
        batch_->r.tokens += r.tokens;
    }

    /// Takes entry e out of the index, the eviction order and the totals (never allocates).
    void detach(entry_id id, const entry& e) noexcept {
        index_.erase(e.where);
        if (!e.pinned) order_.erase({Eviction::rank(e.stats), id});
        bytes_ -= e.bytes;
        tokens_ -= e.n_tokens;
    }

    /// Undoes the linking of save()'s new entry (never allocates).
    void unlink_new(entry_id id) noexcept {
        const auto it = entries_.find(id);
        entry& e = it->second;
        detach(id, e);
        e.checkpoints.clear();  // destroyed, not released: the store's undo record restores the cache
        entries_.erase(it);
    }

    bool entry_valid(const Cache& cache, const entry& e) const {
        if constexpr (detail::checks_entries<Store, Cache>) {
            if (!store_.valid(cache, e.state)) return false;
            for (const auto& ck : e.checkpoints)
                if (!store_.valid(cache, ck.state)) return false;
        }
        static_cast<void>(cache);
        static_cast<void>(e);
        return true;
    }

    /// Phase 1: remembers the key of an evicted entry for evicted_lcp (complete or nothing;
    /// unpush_ghosts undoes it, trim_ghosts forgets the oldest in phase 2).
    void push_ghost(removal& r, const entry& e) {
        std::vector<key_symbol> key;
        key_symbols(e.tokens, key);
        if (key.size() > evicted_memory) return;
        radix_index::position at;
        if (!ghost_.insert(e.salt, key, 0, &at)) return;  // already remembered
        try {
            ghost_order_.emplace_back(e.salt, std::move(key));
        } catch (...) {
            ghost_.erase(at);
            throw;
        }
        ghost_symbols_ += ghost_order_.back().second.size();
        ++r.n_ghost;
    }
    void unpush_ghosts(removal& r) noexcept {
        for (; r.n_ghost > 0; --r.n_ghost) {
            auto& [salt, k] = ghost_order_.back();
            ghost_.erase(salt, k);
            ghost_symbols_ -= k.size();
            ghost_order_.pop_back();
        }
    }
    void trim_ghosts() noexcept {
        while (ghost_symbols_ > evicted_memory) {
            auto& [salt, k] = ghost_order_.front();
            ghost_.erase(salt, k);
            ghost_symbols_ -= k.size();
            ghost_order_.pop_front();
        }
    }

    static bool qualifies(std::uint32_t lcp, std::uint32_t len, double n_req, double fk_slot, double sim_slot,
                          std::size_t slot_lcp) noexcept {
        if (lcp == 0) return false;
        if (lcp == len && lcp > slot_lcp) return true;  // exact prefix, longer than the slot's
        const double f_keep = static_cast<double>(lcp) / static_cast<double>(len);
        const double sim = static_cast<double>(lcp) / n_req;
        return f_keep >= min_f_keep && f_keep > fk_slot && sim > sim_slot;
    }

    /// Changes an entry's stats, moving its element of the eviction order (never allocates).
    template <class F>
    bool update_stats(entry_id id, F f) noexcept {
        const auto it = entries_.find(id);
        if (it == entries_.end()) return false;
        if (it->second.pinned) {
            f(it->second.stats);
            return true;
        }
        auto node = order_.extract({Eviction::rank(it->second.stats), id});
        f(it->second.stats);
        node.value().first = Eviction::rank(it->second.stats);
        order_.insert(std::move(node));
        return true;
    }

    /// The entry that contains the prompt in key_ (a save found it: it counts as used).
    std::optional<entry_id> extension_of(std::uint64_t salt) const {
        std::optional<entry_id> out;
        index_.candidates(salt, key_, [&](const radix_index::candidate& c) {
            if (c.lcp == key_.size()) out = c.id;
            return false;
        });
        return out;
    }

    void release_all(Cache& cache, std::vector<checkpoint>& cks) {
        for (auto& ck : cks) store_.release(cache, ck.state);
        cks.clear();
    }

    prompt_cache_limits limits_;
    Store store_;
    radix_index index_;                                  // (salt, key) -> id of every entry
    entry_map entries_;                                  // every entry, by id (ids() in increasing order)
    order_set order_;                                    // every unpinned entry, eviction order
    std::size_t bytes_ = 0;                              // sum of entries' bytes
    std::size_t tokens_ = 0;                             // sum of entries' token counts
    std::uint64_t clock_ = 0;                            // logical time of inserts and hits
    entry_id next_id_ = 1;
    prefix_cache_metrics metrics_;
    std::vector<key_symbol> key_;  // scratch: key symbols of the prompt being saved
    radix_index ghost_;            // keys of recently evicted entries (id unused)
    std::deque<std::pair<std::uint64_t, std::vector<key_symbol>>> ghost_order_;  // (salt, key), oldest first
    std::size_t ghost_symbols_ = 0;  // symbols in ghost_order_
    std::optional<batch_state> batch_;  // begin_batch .. commit_batch / rollback_batch
};

KVCACHE_END_NAMESPACE
