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
#pragma once

#include <algorithm>      // std::max
#include <concepts>       // std::default_initializable
#include <cstddef>        // std::size_t
#include <cstdint>        // fixed-width integers
#include <optional>       // lookup result
#include <set>            // eviction order
#include <string>         // messages
#include <unordered_map>  // entries by id
#include <utility>        // std::move
#include <vector>         // checkpoints, key scratch

#include "../error.hpp"
#include "../memory/memory.hpp"
#include "../reuse/eviction.hpp"
#include "entry_store.hpp"
#include "../tokens/prompt_tokens.hpp"
#include "radix_index.hpp"

KVCACHE_BEGIN_NAMESPACE

/// State of a sliding-window sequence after processing positions up to pos_max (F23).
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

/// Cumulative counters, named like vLLM's prefix-cache metrics (prefix_cache_queries, ...).
struct prefix_cache_metrics {
    std::uint64_t queries = 0;       ///< lookups
    std::uint64_t hits = 0;          ///< lookups that selected an entry
    std::uint64_t query_tokens = 0;  ///< request tokens looked up
    std::uint64_t hit_tokens = 0;    ///< tokens reused from selected entries (their lcp)
    std::uint64_t inserts = 0;       ///< entries stored
    std::uint64_t skipped = 0;       ///< saves skipped because an entry already contained the prompt
    std::uint64_t evictions = 0;     ///< entries evicted by the limits (or to make room in the store)
    std::uint64_t removed_prefixes = 0;  ///< entries dropped because a new entry extends them
    std::size_t bytes = 0;           ///< bytes held now
    std::size_t tokens = 0;          ///< tokens held now
    std::size_t entries = 0;         ///< entries held now
    /// hit_tokens / query_tokens (0 without queries).
    [[nodiscard]] double token_hit_rate() const noexcept {
        return query_tokens == 0 ? 0.0 : static_cast<double>(hit_tokens) / static_cast<double>(query_tokens);
    }
};

/// Options of one saved entry.
struct entry_options {
    std::uint64_t salt = 0;     ///< tenant namespace: part of the key, lookups never cross it
    std::int32_t priority = 0;  ///< used by reuse::evict_priority (larger = kept longer)
    bool pinned = false;        ///< never evicted by the limits
    std::uint64_t hits = 0;     ///< hits carried over from an earlier life of the entry (reuse::evict_lfu)
};

/// The global prompt cache for cache type Cache. Store keeps the K/V state
/// (copy_store, state_store or shared_store), Eviction orders evictions (reuse::evict_lru, ...).
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
    /// Changes the limits and evicts what no longer fits.
    void set_limits(Cache& cache, prompt_cache_limits limits) {
        limits_ = limits;
        enforce_limits(cache);
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

    /// Saves the state of sequence seq, which holds `tokens`, as a new entry (llama-server's
    /// prompt_save). Skipped (returns nullopt) if tokens is empty or an entry of the same
    /// tenant already starts with tokens; entries that are prefixes of tokens are dropped
    /// (unless pinned). Then the limits are enforced. Checkpoints move into the entry.
    std::optional<entry_id> save(Cache& cache, seq_id_t seq, const prompt_tokens& tokens,
                                 const entry_options& opt = {}, std::vector<checkpoint> checkpoints = {}) {
        if (tokens.empty()) {
            release_all(cache, checkpoints);
            return std::nullopt;
        }
        key_symbols(tokens, key_);
        if (index_.has_extension(opt.salt, key_)) {
            ++metrics_.skipped;
            touch_extension(opt.salt);
            release_all(cache, checkpoints);
            return std::nullopt;
        }
        for (const auto& [id, len] : index_.prefixes_of(opt.salt, key_)) {
            if (entries_.at(id).pinned) continue;
            ++metrics_.removed_prefixes;
            erase(cache, id);
        }
        result<handle> h = store_.save(cache, seq);
        while (!h && h.code() == errc::no_space && evict_one(cache)) h = store_.save(cache, seq);
        if (!h) {
            release_all(cache, checkpoints);
            return std::nullopt;
        }
        key_symbols(tokens, key_);  // erase() above reused the scratch
        const entry_id id = next_id_++;
        entry e{tokens, opt.salt, std::move(h).value(), std::move(checkpoints), 0, {++clock_, opt.hits, opt.priority}, opt.pinned};
        e.bytes = store_.bytes(cache, e.state);
        for (const auto& ck : e.checkpoints) e.bytes += store_.bytes(cache, ck.state);
        const bool inserted = index_.insert(opt.salt, key_, id);
        KVCACHE_ASSERT(inserted);
        static_cast<void>(inserted);
        bytes_ += e.bytes;
        tokens_ += e.tokens.size();
        auto& stored = entries_.emplace(id, std::move(e)).first->second;
        if (!stored.pinned) order_.emplace(Eviction::rank(stored.stats), id);
        ++metrics_.inserts;
        enforce_limits(cache);
        return id;
    }

    /// Selects the entry for `request` (tenant salt) given the requesting slot's own state:
    /// slot_lcp = common prefix of the slot's tokens and the request, slot_len = slot's size.
    /// O(request length) through the radix index. Counts a query (and a hit).
    [[nodiscard]] std::optional<selection> find(const prompt_tokens& request, std::uint64_t salt = 0,
                                                std::size_t slot_lcp = 0, std::size_t slot_len = 0) {
        ++metrics_.queries;
        metrics_.query_tokens += request.size();
        auto s = select(request, salt, slot_lcp, slot_len);
        if (s) {
            ++metrics_.hits;
            metrics_.hit_tokens += s->lcp;
        }
        return s;
    }

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
    /// from the cache. On error (unknown id, dst not empty, no space) nothing changes.
    result<loaded> load(Cache& cache, seq_id_t dst, entry_id id) {
        const auto it = entries_.find(id);
        if (it == entries_.end())
            return detail::make_error(errc::invalid_argument, "prompt_cache::load: no entry with id " + std::to_string(id));
        result<void> r = store_.load(cache, dst, it->second.state);
        if (!r) return detail::make_error(r.code(), r.message());
        entry& e = it->second;
        detach(id, e);
        loaded out{std::move(e.tokens), std::move(e.checkpoints), e.stats.hits + 1};
        store_.release(cache, e.state);
        entries_.erase(it);
        return out;
    }

    /// Removes entry id (its state is released); returns false if unknown.
    bool erase(Cache& cache, entry_id id) {
        const auto it = entries_.find(id);
        if (it == entries_.end()) return false;
        entry& e = it->second;
        detach(id, e);
        store_.release(cache, e.state);
        release_all(cache, e.checkpoints);
        entries_.erase(it);
        return true;
    }

    /// Pins (never evicted) or unpins an entry; returns false if unknown.
    bool set_pinned(Cache& cache, entry_id id, bool pinned) {
        const auto it = entries_.find(id);
        if (it == entries_.end()) return false;
        if (it->second.pinned == pinned) return true;
        it->second.pinned = pinned;
        if (pinned)
            order_.erase({Eviction::rank(it->second.stats), id});
        else
            order_.emplace(Eviction::rank(it->second.stats), id);
        enforce_limits(cache);
        return true;
    }
    /// Sets an entry's priority (reuse::evict_priority); returns false if unknown.
    bool set_priority(entry_id id, std::int32_t priority) {
        return update_stats(id, [&](entry_stats& s) { s.priority = priority; });
    }

    /// Removes every entry.
    void clear(Cache& cache) {
        for (entry_id id : ids()) erase(cache, id);
    }

    /// Evicts entries in eviction order while a limit is exceeded, keeping at least one
    /// entry (llama-server's update()). Pinned entries are never evicted.
    void enforce_limits(Cache& cache) {
        if (limits_.limit_bytes > 0)
            while (entries_.size() > 1 && bytes_ > limits_.limit_bytes)
                if (!evict_one(cache)) break;
        if (limits_.limit_tokens > 0) {
            const double per_token = std::max(1.0, static_cast<double>(bytes_) / static_cast<double>(std::max<std::size_t>(1, tokens_)));
            const std::size_t limit_now =
                limits_.limit_bytes > 0
                    ? std::max(limits_.limit_tokens, static_cast<std::size_t>(static_cast<double>(limits_.limit_bytes) / per_token))
                    : limits_.limit_tokens;
            while (entries_.size() > 1 && tokens_ > limit_now)
                if (!evict_one(cache)) break;
        }
    }

    /// Evicts the first entry in eviction order; false if every entry is pinned (or none).
    bool evict_one(Cache& cache) {
        if (order_.empty()) return false;
        const entry_id victim = order_.begin()->second;
        ++metrics_.evictions;
        erase(cache, victim);
        return true;
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
    };

    /// Removes entry e from the index, the eviction order and the totals (not from entries_).
    void detach(entry_id id, const entry& e) {
        key_symbols(e.tokens, key_);
        index_.erase(e.salt, key_);
        if (!e.pinned) order_.erase({Eviction::rank(e.stats), id});
        bytes_ -= e.bytes;
        tokens_ -= e.tokens.size();
    }

    static bool qualifies(std::uint32_t lcp, std::uint32_t len, double n_req, double fk_slot, double sim_slot,
                          std::size_t slot_lcp) noexcept {
        if (lcp == 0) return false;
        if (lcp == len && lcp > slot_lcp) return true;  // exact prefix, longer than the slot's
        const double f_keep = static_cast<double>(lcp) / static_cast<double>(len);
        const double sim = static_cast<double>(lcp) / n_req;
        return f_keep >= min_f_keep && f_keep > fk_slot && sim > sim_slot;
    }

    template <class F>
    bool update_stats(entry_id id, F f) {
        const auto it = entries_.find(id);
        if (it == entries_.end()) return false;
        if (!it->second.pinned) order_.erase({Eviction::rank(it->second.stats), id});
        f(it->second.stats);
        if (!it->second.pinned) order_.emplace(Eviction::rank(it->second.stats), id);
        return true;
    }

    /// A save found an entry containing the prompt: that entry counts as used.
    void touch_extension(std::uint64_t salt) {
        index_.candidates(salt, key_, [&](const radix_index::candidate& c) {
            if (c.lcp == key_.size()) update_stats(c.id, [&](entry_stats& s) { s.last_use = ++clock_; });
            return false;
        });
    }

    void release_all(Cache& cache, std::vector<checkpoint>& cks) {
        for (auto& ck : cks) store_.release(cache, ck.state);
        cks.clear();
    }

    prompt_cache_limits limits_;
    Store store_;
    radix_index index_;                                  // (salt, key) -> id of every entry
    std::unordered_map<entry_id, entry> entries_;         // every entry
    std::set<std::pair<eviction_rank, entry_id>> order_;  // every unpinned entry, eviction order
    std::size_t bytes_ = 0;                               // sum of entries' bytes
    std::size_t tokens_ = 0;                              // sum of entries' token counts
    std::uint64_t clock_ = 0;                             // logical time of inserts and hits
    entry_id next_id_ = 1;
    prefix_cache_metrics metrics_;
    std::vector<key_symbol> key_;  // scratch: key symbols of the prompt being saved or erased
};

KVCACHE_END_NAMESPACE
