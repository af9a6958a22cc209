// kvcache: a radix tree over prompts, the index of the global prompt cache (F21).
//
// Keys are prompts turned into one 64-bit symbol per position: a text token is
// its id (< 2^31); a media position is a hash of (chunk id, n_pos, offset) with
// the top bit set, so text never equals media and two chunks compare by id and
// length. Each tenant (salt) has its own tree, so lookups never cross tenants.
//
// Each node keeps the length of the shortest entry in its subtree and, per
// child, that child's shortest entry (an ordered set). A lookup walks the
// request once, O(request length), and then reports one candidate per depth d
// of the walk, deepest first: the shortest entry whose key shares exactly d
// symbols with the request (best f_keep = d / length for that d). Candidate
// lookups never scan entries; insert and erase cost O(key length + path nodes
// x log fan-out).
//
// Allocation failure: insert allocates every node, label and set element it needs
// before its first change (complete or nothing); erase never allocates (noexcept). For
// that, every node's label reserves the full length of the keys below it (its depth),
// so that merging a node into its only child after an erase fits in the child's label:
// the index holds at most about twice the key symbols of its entries (one full key per
// leaf, at most one more per branching node).
#pragma once

#include <algorithm>      // std::min
#include <cstddef>        // std::size_t
#include <cstdint>        // fixed-width integers
#include <limits>         // no-entry marker
#include <map>            // children by first symbol, trees by salt (node handles: no allocation to link)
#include <memory>         // std::unique_ptr
#include <set>            // per-node child minima
#include <utility>        // std::pair
#include <vector>         // labels

#include "../tokens/prompt_tokens.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Key symbol of one prompt position.
using key_symbol = std::uint64_t;

namespace detail {
[[nodiscard]] constexpr std::uint64_t mix64(std::uint64_t x) noexcept {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}
}  // namespace detail

/// Appends the key symbols of p (one per position) to out, after clearing it.
inline void key_symbols(const prompt_tokens& p, std::vector<key_symbol>& out) {
    const auto t = p.tokens();
    out.resize(t.size());
    for (std::size_t i = 0; i < t.size(); ++i) out[i] = static_cast<key_symbol>(static_cast<std::uint32_t>(t[i]));
    for (const media_chunk& c : p.media()) {
        const std::uint64_t h = detail::mix64(c.id ^ detail::mix64(c.n_pos));
        for (std::uint32_t k = 0; k < c.n_pos; ++k)
            out[c.begin + k] = (std::uint64_t{1} << 63) | (detail::mix64(h + k) >> 1);
    }
}

/// Radix tree from (salt, key) to an entry id; at most one entry per (salt, key).
/// insert: complete or nothing under std::bad_alloc; erase and clear: noexcept.
/// Thread safety: like a standard container: concurrent const calls (find, candidates,
/// prefixes_of, has_extension) are safe; insert, erase and clear need exclusive access.
class radix_index {
    struct node;

public:
    using entry_id = std::uint64_t;
    static constexpr std::uint32_t no_entry_len = std::numeric_limits<std::uint32_t>::max();

    /// A lookup candidate: entry `id` of `len` symbols shares exactly `lcp` symbols with the request.
    struct candidate {
        entry_id id = 0;
        std::uint32_t lcp = 0;
        std::uint32_t len = 0;
    };

    /// Number of entries.
    [[nodiscard]] std::size_t size() const noexcept { return n_entries_; }
    /// Number of nodes (roots included), for memory accounting and tests.
    [[nodiscard]] std::size_t node_count() const noexcept { return n_nodes_; }

    /// Entry stored at exactly this key, if any.
    [[nodiscard]] const entry_id* find(std::uint64_t salt, std::span<const key_symbol> key) const {
        const auto r = roots_.find(salt);
        if (r == roots_.end()) return nullptr;
        const walk_result w = walk(*r->second, key);
        if (w.consumed != key.size() || w.partial != nullptr || !w.path.back()->has_entry) return nullptr;
        return &w.path.back()->entry;
    }

    /// Where an entry is stored (insert's out parameter): valid until that entry is erased
    /// or the index cleared; erase(position) removes it without the key.
    class position {
        friend class radix_index;

    public:
        /// Whether it was set by an insert.
        [[nodiscard]] bool valid() const noexcept { return at_ != nullptr; }

    private:
        node* at_ = nullptr;
        std::uint64_t salt_ = 0;
    };

    /// Stores entry id at key; returns false (and changes nothing) if the key already has one.
    /// Allocates everything it needs before its first change: a std::bad_alloc leaves the
    /// index as it was. With `where`, stores the entry's position there.
    bool insert(std::uint64_t salt, std::span<const key_symbol> key, entry_id id, position* where = nullptr) {
        // Phase 1: allocate (nothing changes).
        tree_map::node_type new_root;
        node* root = nullptr;
        if (const auto r = roots_.find(salt); r != roots_.end()) {
            root = r->second.get();
        } else {
            tree_map tmp;
            tmp.emplace(salt, std::make_unique<node>());
            new_root = tmp.extract(tmp.begin());
            root = new_root.mapped().get();
        }
        const walk_result w = walk(*root, key);
        node* at = w.path.back();
        const bool need_leaf = w.consumed < key.size();
        if (!need_leaf && w.partial == nullptr && at->has_entry) return false;
        std::unique_ptr<node> mid;
        child_map::node_type mid_link;  // mid's link to the split child
        min_set::node_type mid_min;     // the split child's minimum in mid
        if (w.partial != nullptr) {
            node& c = *w.partial;
            const std::uint32_t m = w.partial_len;
            mid = std::make_unique<node>();
            mid->label.reserve(at->depth + m);  // capacity >= depth (see the file comment)
            mid->label.assign(c.label.begin(), c.label.begin() + m);
            mid_link = make_link(c.label[m]);
            mid_min = make_min(c.sub_min, c.label[m]);
        }
        std::unique_ptr<node> leaf;
        child_map::node_type leaf_link;
        min_set::node_type leaf_min;
        if (need_leaf) {
            leaf = std::make_unique<node>();
            leaf->label.reserve(key.size());
            leaf->label.assign(key.begin() + static_cast<std::ptrdiff_t>(w.consumed), key.end());
            leaf_link = make_link(leaf->label.front());
            leaf_min = make_min(static_cast<std::uint32_t>(key.size()), leaf->label.front());
        }
        // Phase 2: link (no allocation: node handles, reserved labels).
        if (!new_root.empty()) {
            roots_.insert(std::move(new_root));
            ++n_nodes_;
        }
        if (mid) at = split(*at, *w.partial, w.partial_len, std::move(mid), std::move(mid_link), std::move(mid_min));
        if (leaf) {
            node* raw = leaf.get();
            raw->parent = at;
            raw->depth = static_cast<std::uint32_t>(key.size());
            raw->has_entry = true;
            raw->entry = id;
            raw->sub_min = raw->depth;
            leaf_link.mapped() = std::move(leaf);
            at->children.insert(std::move(leaf_link));
            at->child_mins.insert(std::move(leaf_min));
            ++n_nodes_;
            refresh(at);
            at = raw;
        } else {
            at->has_entry = true;
            at->entry = id;
            refresh(at);
        }
        ++n_entries_;
        if (where != nullptr) {
            where->at_ = at;
            where->salt_ = salt;
        }
        return true;
    }

    /// Removes the entry at key; returns false if there is none. Never allocates.
    bool erase(std::uint64_t salt, std::span<const key_symbol> key) noexcept {
        const auto r = roots_.find(salt);
        if (r == roots_.end()) return false;
        node* n = locate(*r->second, key);
        if (n == nullptr || !n->has_entry) return false;
        position p;
        p.at_ = n;
        p.salt_ = salt;
        erase(p);
        return true;
    }
    /// Removes the entry stored at p (from insert; the entry must still be there). Never allocates.
    void erase(position p) noexcept {
        node* n = p.at_;
        KVCACHE_ASSERT(n != nullptr && n->has_entry);
        n->has_entry = false;
        --n_entries_;
        refresh(n);
        prune(n);
        const auto r = roots_.find(p.salt_);
        KVCACHE_ASSERT(r != roots_.end());
        if (r->second->children.empty() && !r->second->has_entry) {
            roots_.erase(r);
            --n_nodes_;
        }
    }

    /// Entries whose keys are prefixes of key (key itself included), as (id, length).
    [[nodiscard]] std::vector<std::pair<entry_id, std::uint32_t>> prefixes_of(std::uint64_t salt,
                                                                            std::span<const key_symbol> key) const {
        std::vector<std::pair<entry_id, std::uint32_t>> out;
        const auto r = roots_.find(salt);
        if (r == roots_.end()) return out;
        const walk_result w = walk(*r->second, key);
        for (const node* n : w.path)
            if (n->has_entry) out.emplace_back(n->entry, n->depth);
        return out;
    }

    /// Whether some entry's key starts with key (key itself included).
    [[nodiscard]] bool has_extension(std::uint64_t salt, std::span<const key_symbol> key) const {
        const auto r = roots_.find(salt);
        if (r == roots_.end()) return false;
        const walk_result w = walk(*r->second, key);
        if (w.consumed != key.size()) return false;
        const node* n = w.partial != nullptr ? w.partial : w.path.back();
        return n->sub_min != no_entry_len;
    }

    /// Calls f(candidate) for each depth d >= 1 the request's walk reaches, deepest first,
    /// with the shortest entry that shares exactly d symbols with key; stops when f returns false.
    /// O(key length + path nodes): no entry is scanned.
    template <class F>
    void candidates(std::uint64_t salt, std::span<const key_symbol> key, F&& f) const {
        const auto r = roots_.find(salt);
        if (r == roots_.end()) return;
        const walk_result w = walk(*r->second, key);
        const node* on_path = nullptr;  // child of the current path node that the request follows
        if (w.partial != nullptr) {
            const std::uint32_t lcp = w.path.back()->depth + w.partial_len;
            if (w.partial->sub_min != no_entry_len &&
                !f(candidate{shortest_in(*w.partial), lcp, w.partial->sub_min}))
                return;
            on_path = w.partial;
        }
        for (auto it = w.path.rbegin(); it != w.path.rend(); ++it) {
            const node* n = *it;
            if (n->depth == 0) break;
            std::uint32_t best = no_entry_len;
            entry_id id = 0;
            if (n->has_entry) {
                best = n->depth;
                id = n->entry;
            } else {
                for (const auto& [len, sym] : n->child_mins) {
                    if (on_path != nullptr && sym == on_path->label.front()) continue;
                    best = len;
                    id = shortest_in(*n->children.at(sym));
                    break;
                }
            }
            if (best != no_entry_len && !f(candidate{id, n->depth, best})) return;
            on_path = n;
        }
    }

    /// Calls f(salt, depth, label, entry) for every node: trees by increasing salt, each in
    /// pre-order with children by increasing first symbol; entry is nullptr for a node
    /// without one (a root's label is empty). A comparable picture of the structure, for
    /// tests and tools.
    template <class F>
    void for_each_node(F&& f) const {
        for (const auto& [salt, root] : roots_) visit_node(salt, *root, f);
    }

    /// Removes every entry.
    void clear() noexcept {
        roots_.clear();
        n_entries_ = 0;
        n_nodes_ = 0;
    }

private:
    struct node {
        std::vector<key_symbol> label;  // edge from the parent; empty only for a root
        node* parent = nullptr;
        std::uint32_t depth = 0;        // symbols from the root to the end of this node
        bool has_entry = false;
        entry_id entry = 0;             // valid when has_entry
        std::map<key_symbol, std::unique_ptr<node>> children;  // by first label symbol
        // Shortest entry length in this subtree; no_entry_len when it holds none. Every
        // non-root node holds an entry in its subtree (empty leaves are pruned).
        std::uint32_t sub_min = no_entry_len;
        std::set<std::pair<std::uint32_t, key_symbol>> child_mins;  // (child sub_min, child first symbol)
    };

    using child_map = std::map<key_symbol, std::unique_ptr<node>>;
    using tree_map = std::map<std::uint64_t, std::unique_ptr<node>>;
    using min_set = std::set<std::pair<std::uint32_t, key_symbol>>;

    /// A detached link (first symbol -> empty child) to insert later without allocating.
    static child_map::node_type make_link(key_symbol first) {
        child_map tmp;
        tmp.emplace(first, nullptr);
        return tmp.extract(tmp.begin());
    }
    static min_set::node_type make_min(std::uint32_t len, key_symbol first) {
        min_set tmp;
        tmp.emplace(len, first);
        return tmp.extract(tmp.begin());
    }

    /// The node whose path from root spells exactly key, or nullptr. Never allocates.
    static node* locate(node& root, std::span<const key_symbol> key) noexcept {
        node* n = &root;
        std::size_t i = 0;
        while (i < key.size()) {
            const auto it = n->children.find(key[i]);
            if (it == n->children.end()) return nullptr;
            node* c = it->second.get();
            if (c->label.size() > key.size() - i) return nullptr;
            for (std::size_t m = 1; m < c->label.size(); ++m)
                if (c->label[m] != key[i + m]) return nullptr;
            i += c->label.size();
            n = c;
        }
        return n;
    }

    struct walk_result {
        std::vector<node*> path;     // fully matched nodes from the root
        node* partial = nullptr;     // child whose label matched partially (partial_len >= 1)
        std::uint32_t partial_len = 0;
        std::size_t consumed = 0;    // symbols of the key matched
    };

    static walk_result walk(const node& root, std::span<const key_symbol> key) {
        walk_result w;
        node* n = const_cast<node*>(&root);  // the tree owns its nodes; constness is restored by the callers
        w.path.push_back(n);
        std::size_t i = 0;
        while (i < key.size()) {
            const auto it = n->children.find(key[i]);
            if (it == n->children.end()) break;
            node* c = it->second.get();
            const std::size_t lim = std::min(c->label.size(), key.size() - i);
            std::size_t m = 1;
            while (m < lim && c->label[m] == key[i + m]) ++m;
            i += m;
            if (m < c->label.size()) {
                w.partial = c;
                w.partial_len = static_cast<std::uint32_t>(m);
                break;
            }
            n = c;
            w.path.push_back(n);
        }
        w.consumed = i;
        return w;
    }

    /// Splits child c of p after m label symbols with the preallocated middle node (its
    /// label set), its link to c and c's minimum; returns the middle node. Never allocates.
    node* split(node& p, node& c, std::uint32_t m, std::unique_ptr<node> mid, child_map::node_type link,
                min_set::node_type c_min) noexcept {
        mid->parent = &p;
        mid->depth = p.depth + m;
        mid->sub_min = c.sub_min;
        const key_symbol first = c.label.front();
        std::unique_ptr<node>& slot = p.children.at(first);
        std::unique_ptr<node> owned = std::move(slot);
        c.label.erase(c.label.begin(), c.label.begin() + m);
        c.parent = mid.get();
        link.mapped() = std::move(owned);
        mid->children.insert(std::move(link));
        if (c.sub_min != no_entry_len) mid->child_mins.insert(std::move(c_min));
        node* raw = mid.get();
        slot = std::move(mid);  // p's minimum for `first` is unchanged (mid's sub_min is c's)
        ++n_nodes_;
        return raw;
    }

    /// Recomputes sub_min of n and its ancestors after n's entry or children changed.
    /// Moves the parents' set elements (extract / insert): never allocates.
    static void refresh(node* n) noexcept {
        while (n != nullptr) {
            const std::uint32_t now =
                n->has_entry ? n->depth : (n->child_mins.empty() ? no_entry_len : n->child_mins.begin()->first);
            if (now == n->sub_min) return;
            node* p = n->parent;
            if (p != nullptr) {
                const key_symbol first = n->label.front();
                // A non-root node always had an entry below it, so its element exists.
                auto e = p->child_mins.extract({n->sub_min, first});
                KVCACHE_ASSERT(!e.empty());
                if (now != no_entry_len) {
                    e.value().first = now;
                    p->child_mins.insert(std::move(e));
                }
            }
            n->sub_min = now;
            n = p;
        }
    }

    /// Removes n if it became an empty leaf and merges a node left without an entry and
    /// with one child into that child (the child's label reserves room for it). Never allocates.
    void prune(node* n) noexcept {
        while (n->parent != nullptr && !n->has_entry && n->children.empty()) {
            node* p = n->parent;
            p->children.erase(n->label.front());
            --n_nodes_;
            n = p;
        }
        if (n->parent != nullptr && !n->has_entry && n->children.size() == 1) {
            node* c = n->children.begin()->second.get();
            KVCACHE_ASSERT(c->label.capacity() >= n->label.size() + c->label.size());
            c->label.insert(c->label.begin(), n->label.begin(), n->label.end());  // within capacity
            c->parent = n->parent;
            // n's minimum in its parent is c's (n holds no entry): the element stays.
            std::unique_ptr<node> keep = std::move(n->children.begin()->second);
            n->parent->children.at(c->label.front()) = std::move(keep);  // destroys n
            --n_nodes_;
        }
    }

    template <class F>
    static void visit_node(std::uint64_t salt, const node& n, F& f) {
        f(salt, n.depth, std::span<const key_symbol>(n.label), n.has_entry ? &n.entry : nullptr);
        for (const auto& [sym, c] : n.children) visit_node(salt, *c, f);
    }

    /// Id of an entry of length n.sub_min in n's subtree.
    static entry_id shortest_in(const node& start) {
        const node* n = &start;
        while (!(n->has_entry && n->depth == n->sub_min)) n = n->children.at(n->child_mins.begin()->second).get();
        return n->entry;
    }

    tree_map roots_;  // one tree per salt
    std::size_t n_entries_ = 0;
    std::size_t n_nodes_ = 0;  // every node of every tree, roots included
};

KVCACHE_END_NAMESPACE
