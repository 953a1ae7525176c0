// The page radix tree: the algorithms of the former Python tree (kept as the tests' reference
// model, tests/mempool/radix_model.py), step for step, so that both give the same answers.
#include "tree.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <queue>
#include <set>
#include <tuple>

namespace radix {

namespace {

// A heap is compacted when its stale entries outnumber the current ones by this factor (plus
// a floor), so dropping them is paid for by the pushes that made them.
constexpr int64_t kStaleFactor = 2;
constexpr int64_t kStaleFloor = 64;
// Children are looked up by scan up to this many, through a hash index beyond.
constexpr size_t kIndexFrom = 8;
// An edge is compared with a prompt this many pages at a time, then page by page where they part.
constexpr size_t kComparedPages = 32;

// min-heaps: std::push_heap builds a max-heap, so the comparators say "comes later"
struct LeafLater {
    bool operator()(const LeafEntry& a, const LeafEntry& b) const {
        return a.seen != b.seen ? a.seen > b.seen : a.stamp > b.stamp;
    }
};
struct ExpiryLater {
    bool operator()(const ExpiryEntry& a, const ExpiryEntry& b) const {
        return a.seen != b.seen ? a.seen > b.seen : a.seq > b.seq;
    }
};

[[noreturn]] void invalid(const std::string& msg) { throw TreeError(ErrorKind::InvalidRequest, msg); }

}  // namespace

Tree::Tree(uint32_t page_size, uint32_t stride) : ps_(page_size), stride_(stride) {
    if (page_size == 0) invalid("page_size must be a positive int");
    nodes_.emplace_back();
    Node& root = nodes_.back();
    root.lock_ref = 1;
    root.attached = true;
    root.live = true;
}

// ------------------------------------------------------------------ nodes and children

NodeId Tree::alloc() {
    NodeId id;
    if (!free_.empty()) {
        id = free_.back();
        free_.pop_back();
    } else {
        if (nodes_.size() >= kNone - 1) throw std::length_error("radix tree: too many nodes");
        id = static_cast<NodeId>(nodes_.size());
        nodes_.emplace_back();
    }
    Node& n = nodes_[id];
    n.live = true;
    n.attached = true;
    return id;
}

void Tree::free_node(NodeId id) {
    Node& n = nodes_[id];
    std::vector<uint32_t>().swap(n.key);
    std::vector<uint64_t>().swap(n.value);
    std::vector<NodeId>().swap(n.children);
    n.index.reset();
    std::vector<HolderSeen>().swap(n.holders);
    n.parent = kNone;
    n.gen++;
    n.lock_ref = 0;
    n.tier = 0;
    n.last_access = 0.0;
    n.lru_stamp = 0;
    n.attached = false;
    n.live = false;
    n.collided = false;
    free_.push_back(id);
}

void Tree::check_handle(NodeId id, uint32_t gen) const {
    if (!valid(id, gen)) {
        throw TreeError(ErrorKind::StaleNode,
                        "stale tree node: it was evicted, deleted, pruned or reset out of the "
                        "tree since this handle was taken");
    }
}

uint64_t Tree::page_hash(const uint32_t* page) const {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ ps_;
    for (uint32_t i = 0; i < ps_; i++) {
        h ^= page[i];
        h *= 0xBF58476D1CE4E5B9ull;
        h ^= h >> 31;
    }
    return h;
}

NodeId Tree::find_child(NodeId parent, const uint32_t* page) const {
    const Node& p = nodes_[parent];
    if (p.index) {
        auto it = p.index->find(page_hash(page));
        if (it == p.index->end()) return kNone;
        const Node& c = nodes_[it->second];
        return std::memcmp(c.key.data(), page, ps_ * sizeof(uint32_t)) == 0 ? it->second : kNone;
    }
    for (NodeId c : p.children) {
        const uint32_t* k = nodes_[c].key.data();
        if (k[0] == page[0] && std::memcmp(k, page, ps_ * sizeof(uint32_t)) == 0) return c;
    }
    return kNone;
}

void Tree::build_index(NodeId parent) {
    Node& p = nodes_[parent];
    auto index = std::make_unique<std::unordered_map<uint64_t, NodeId>>();
    index->reserve(p.children.size() * 2);
    for (NodeId c : p.children) {
        if (!index->emplace(page_hash(nodes_[c].key.data()), c).second) {
            p.collided = true;  // two different first pages share a hash: scan instead
            p.index.reset();
            return;
        }
    }
    p.index = std::move(index);
}

void Tree::add_child(NodeId parent, NodeId child) {
    Node& p = nodes_[parent];
    p.children.push_back(child);
    if (p.index) {
        if (!p.index->emplace(page_hash(nodes_[child].key.data()), child).second) {
            p.collided = true;
            p.index.reset();
        }
    } else if (!p.collided && p.children.size() > kIndexFrom) {
        build_index(parent);
    }
}

void Tree::remove_child(NodeId parent, NodeId child) {
    Node& p = nodes_[parent];
    auto it = std::find(p.children.begin(), p.children.end(), child);
    if (it != p.children.end()) p.children.erase(it);
    if (p.index) p.index->erase(page_hash(nodes_[child].key.data()));
}

void Tree::replace_child(NodeId parent, NodeId old_child, NodeId new_child) {
    Node& p = nodes_[parent];
    auto it = std::find(p.children.begin(), p.children.end(), old_child);
    *it = new_child;
    if (p.index) (*p.index)[page_hash(nodes_[new_child].key.data())] = new_child;
}

// ------------------------------------------------------------------ walking

bool Tree::edge_is_prefix(const Node& edge, const uint32_t* key, size_t remaining) const {
    return edge.key.size() <= remaining &&
           std::memcmp(edge.key.data(), key, edge.key.size() * sizeof(uint32_t)) == 0;
}

// Whole pages compared with memcmp, a block of them at a time while they agree: a prompt that
// parts from an 8K-token edge near its end (a new question after a shared document, a chat
// template's turn end after the recorded answer) was compared token by token at 0.6 ns each.
size_t Tree::common_pages(const Node& edge, const uint32_t* key, size_t remaining) const {
    size_t limit = std::min(edge.key.size(), remaining);  // whole pages, both
    size_t i = ps_;  // the first page matched already
    const uint32_t* e = edge.key.data();
    const size_t block = kComparedPages * ps_;
    while (i + block <= limit && std::memcmp(e + i, key + i, block * sizeof(uint32_t)) == 0) {
        i += block;
    }
    while (i + ps_ <= limit && std::memcmp(e + i, key + i, ps_ * sizeof(uint32_t)) == 0) {
        i += ps_;
    }
    return i / ps_;
}

size_t Tree::depth(NodeId id) const {
    size_t d = 0;
    while (nodes_[id].parent != kNone) {
        d += nodes_[id].key.size();
        id = nodes_[id].parent;
    }
    return d;
}

std::pair<NodeId, size_t> Tree::descend(const uint32_t* key, size_t n, bool split,
                                        const double* now) {
    NodeId node = kRoot;
    size_t pos = 0;
    while (pos < n) {
        NodeId child = find_child(node, key + pos);
        if (child == kNone) break;
        if (!edge_is_prefix(nodes_[child], key + pos, n - pos)) {
            size_t pages = common_pages(nodes_[child], key + pos, n - pos);
            if (!split) return {child, pos + pages * ps_};
            child = split_node(child, pages);
        }
        if (now) nodes_[child].last_access = *now;
        pos += nodes_[child].key.size();
        node = child;
    }
    return {node, pos};
}

void Tree::subtree(NodeId start, std::vector<NodeId>& out) const {
    // the Python tree's order: a stack, each node's children pushed in insertion order
    std::vector<NodeId> stack{start};
    while (!stack.empty()) {
        NodeId id = stack.back();
        stack.pop_back();
        out.push_back(id);
        const auto& ch = nodes_[id].children;
        stack.insert(stack.end(), ch.begin(), ch.end());
    }
}

void Tree::walk_all(std::vector<NodeId>& out) {
    // every node but the root, in subtree()'s order (a whole-tree walk: counted)
    full_walks_++;
    const auto at = out.size();
    subtree(kRoot, out);
    out.erase(out.begin() + static_cast<std::ptrdiff_t>(at));
}

std::vector<NodeId> Tree::nodes() {
    std::vector<NodeId> out;
    walk_all(out);
    return out;
}

// ------------------------------------------------------------------ public operations

MatchOut Tree::match(const uint32_t* key, size_t n, double now, const double* cutoff,
                     bool split) {
    auto [end, pos] = descend(key, n, split, &now);
    std::vector<NodeId> path;
    for (NodeId walk = end; nodes_[walk].parent != kNone; walk = nodes_[walk].parent) {
        path.push_back(walk);
    }
    std::reverse(path.begin(), path.end());
    MatchOut out;
    size_t d = 0, full = 0;
    for (NodeId step : path) {
        const Node& s = nodes_[step];
        full += s.key.size();
        d = std::min(d + s.key.size(), pos);
        if (stride_ && !s.value.empty()) {
            size_t want = d / ps_ * stride_;
            size_t take = want - out.value.size();
            out.value.insert(out.value.end(), s.value.begin(), s.value.begin() + take);
        }
        for (const HolderSeen& h : s.holders) {
            if (cutoff && h.seen < *cutoff) continue;
            bool found = false;
            for (auto& ht : out.holder_tokens) {
                if (ht.first == h.holder) {
                    ht.second = static_cast<int64_t>(d);
                    found = true;
                    break;
                }
            }
            if (!found) out.holder_tokens.emplace_back(h.holder, static_cast<int64_t>(d));
        }
    }
    out.node = (!path.empty() && d < full) ? nodes_[path.back()].parent : end;
    out.num_tokens = static_cast<int64_t>(pos);
    return out;
}

void Tree::holders(const uint32_t* key, size_t n, double now, double cutoff,
                   std::vector<std::pair<HolderId, int64_t>>& out) {
    NodeId node = kRoot;
    size_t pos = 0;
    while (pos < n) {
        NodeId child = find_child(node, key + pos);
        if (child == kNone) break;
        Node& c = nodes_[child];
        bool whole = edge_is_prefix(c, key + pos, n - pos);
        if (whole) {
            c.last_access = now;
            pos += c.key.size();
        } else {
            pos += common_pages(c, key + pos, n - pos) * ps_;
        }
        for (const HolderSeen& h : c.holders) {
            if (h.seen < cutoff) continue;
            bool found = false;
            for (auto& ht : out) {
                if (ht.first == h.holder) {
                    ht.second = static_cast<int64_t>(pos);
                    found = true;
                    break;
                }
            }
            if (!found) out.emplace_back(h.holder, static_cast<int64_t>(pos));
        }
        if (!whole) break;
        node = child;
    }
}

InsertOut Tree::insert(const uint32_t* key, size_t n, const uint64_t* values, HolderId holder,
                       int32_t tier, double now) {
    InsertOut out;
    size_t pages = n / ps_;
    NodeId node = kRoot;
    size_t pos = 0, existing = 0;
    bool has_holder = holder != kNone;
    while (pos < n) {
        NodeId child = find_child(node, key + pos);
        if (child == kNone) {
            if (tier <= nodes_[node].tier) unqueue_leaf(node);  // it gets a child
            NodeId leaf = alloc();
            Node& l = nodes_[leaf];
            l.key.assign(key + pos, key + n);
            if (values && stride_) {
                l.value.assign(values + pos / ps_ * stride_, values + pages * stride_);
            }
            l.parent = node;
            l.last_access = now;
            l.tier = tier;
            tiered_ = tiered_ || tier != 0;
            add_child(node, leaf);
            evictable_pages_ += static_cast<int64_t>((n - pos) / ps_);
            queue_leaf(leaf);
            if (has_holder) confirm(leaf, holder, now);
            node = leaf;
            break;
        }
        if (!edge_is_prefix(nodes_[child], key + pos, n - pos)) {
            child = split_node(child, common_pages(nodes_[child], key + pos, n - pos));
        }
        Node& c = nodes_[child];
        size_t span = c.key.size() / ps_;
        if (values && stride_ && !c.value.empty()) {
            const uint64_t* given = values + pos / ps_ * stride_;
            for (size_t i = 0; i < span * stride_; i++) {
                if (given[i] != c.value[i]) out.duplicates.push_back(given[i]);
            }
        }
        c.last_access = now;
        if (has_holder) confirm(child, holder, now);
        existing += span;
        pos += c.key.size();
        node = child;
    }
    if (has_holder) compact_expiry_if_stale();
    out.existing_tokens = static_cast<int64_t>(existing * ps_);
    out.new_tokens = static_cast<int64_t>((pages - existing) * ps_);
    out.node = node;
    return out;
}

std::vector<uint64_t> Tree::erase(const uint32_t* key, size_t n) {
    std::vector<uint64_t> removed;
    auto [node, pos] = descend(key, n, false, nullptr);
    if (node == kRoot || !nodes_[node].children.empty() || pos < depth(node)) return removed;
    std::vector<NodeId> chain{node};
    for (NodeId parent = nodes_[node].parent;
         parent != kRoot && nodes_[parent].children.size() == 1; parent = nodes_[parent].parent) {
        chain.push_back(parent);
    }
    for (NodeId c : chain) {
        if (nodes_[c].lock_ref) {
            throw TreeError(ErrorKind::BlockInUse,
                            "cannot delete: part of this prompt's cache is locked by a request");
        }
    }
    for (NodeId c : chain) detach(c, &removed);  // the leaf first: deepest page first
    return removed;
}

Removed Tree::evict(int64_t num_pages, int32_t tier) {
    Removed out;
    while (out.pages < num_pages) {
        NodeId leaf = pop_lru_leaf(tier);
        if (leaf == kNone) break;
        out.pages += detach(leaf, &out.values);
    }
    return out;
}

void Tree::lock(NodeId id) {
    while (nodes_[id].parent != kNone) {
        Node& n = nodes_[id];
        if (n.lock_ref == 0) {
            unqueue_leaf(id);
            if (n.attached) {
                evictable_pages_ -= pages_of(n);
                protected_pages_ += pages_of(n);
            }
        }
        n.lock_ref++;
        id = n.parent;
    }
}

void Tree::unlock(NodeId id) {
    for (NodeId walk = id; nodes_[walk].parent != kNone; walk = nodes_[walk].parent) {
        if (nodes_[walk].lock_ref <= 0) invalid("unlock of a node that is not locked");
    }
    while (nodes_[id].parent != kNone) {
        Node& n = nodes_[id];
        NodeId parent = n.parent;
        n.lock_ref--;
        if (n.lock_ref == 0) {
            if (n.attached) {
                evictable_pages_ += pages_of(n);
                protected_pages_ -= pages_of(n);
                if (is_tier_leaf(id)) queue_leaf(id);
            } else {
                free_node(id);  // a zombie: detached while locked, now released
            }
        }
        id = parent;
    }
}

int64_t Tree::remove_holder_everywhere(HolderId holder) {
    std::vector<std::pair<NodeId, uint32_t>> emptied;
    if (holder < by_holder_.size() && by_holder_[holder]) {
        auto held = std::move(by_holder_[holder]);
        released_.push_back(holder);
        for (NodeId id : *held) {
            Node& n = nodes_[id];
            auto it = std::find_if(n.holders.begin(), n.holders.end(),
                                   [&](const HolderSeen& h) { return h.holder == holder; });
            if (it != n.holders.end()) n.holders.erase(it);
            if (n.holders.empty()) emptied.emplace_back(id, n.gen);
        }
        holder_entries_ -= static_cast<int64_t>(held->size());
    }
    compact_expiry_if_stale();
    return prune(emptied);
}

int64_t Tree::remove_holder_on_path(HolderId holder, const uint32_t* key, size_t n,
                                    int64_t keep_tokens) {
    size_t keep = static_cast<size_t>(std::max<int64_t>(keep_tokens, 0)) / ps_ * ps_;
    auto [node, pos] = descend(key, std::min(keep, n), true, nullptr);
    // The holder lacks the page after `keep`, so (prefix closure) everything below it too.
    NodeId next = (pos == keep && pos + ps_ <= n) ? find_child(node, key + pos) : kNone;
    if (next == kNone) return 0;
    std::vector<std::pair<NodeId, uint32_t>> emptied;
    if (holder != kNone) {
        std::vector<NodeId> below;
        subtree(next, below);
        for (NodeId id : below) {
            Node& s = nodes_[id];
            for (const HolderSeen& h : s.holders) {
                if (h.holder == holder) {
                    drop_holder(id, holder);
                    if (s.holders.empty()) emptied.emplace_back(id, s.gen);
                    break;
                }
            }
        }
    }
    compact_expiry_if_stale();
    return prune(emptied);
}

int64_t Tree::expire(double older_than) {
    std::vector<std::pair<NodeId, uint32_t>> emptied;
    while (!expiry_.empty() && expiry_.front().seen < older_than) {
        std::pop_heap(expiry_.begin(), expiry_.end(), ExpiryLater());
        ExpiryEntry e = expiry_.back();
        expiry_.pop_back();
        if (!valid(e.node, e.gen) || !nodes_[e.node].attached) continue;  // stale
        Node& n = nodes_[e.node];
        auto it = std::find_if(n.holders.begin(), n.holders.end(),
                               [&](const HolderSeen& h) { return h.holder == e.holder; });
        if (it == n.holders.end()) continue;  // forgotten since
        if (it->seen >= older_than) {         // confirmed again since: re-enter at its time
            expiry_.push_back({it->seen, ++seq_, e.node, e.gen, e.holder});
            std::push_heap(expiry_.begin(), expiry_.end(), ExpiryLater());
            continue;
        }
        drop_holder(e.node, e.holder);
        if (n.holders.empty()) emptied.emplace_back(e.node, n.gen);
    }
    return prune(emptied);
}

NodeId Tree::lru_leaf(int32_t tier) {
    auto& h = heap(tier);
    while (!h.empty()) {
        LeafEntry top = h.front();
        Node& n = nodes_[top.node];
        if (n.lru_stamp != top.stamp) {
            std::pop_heap(h.begin(), h.end(), LeafLater());
            h.pop_back();
        } else if (top.seen != n.last_access) {  // used since it was queued: re-enter
            std::pop_heap(h.begin(), h.end(), LeafLater());
            n.lru_stamp = ++seq_;
            h.back() = {n.last_access, n.lru_stamp, top.node};
            std::push_heap(h.begin(), h.end(), LeafLater());
        } else {
            return top.node;
        }
    }
    return kNone;
}

void Tree::set_tier(NodeId id, int32_t tier) {
    Node& n = nodes_[id];
    if (n.parent == kNone) invalid("the root has no tier");
    if (n.tier == tier) return;
    tiered_ = tiered_ || tier != 0;
    unqueue_leaf(id);
    n.tier = tier;
    requeue_if_leaf(id);
    NodeId parent = n.parent;
    if (is_tier_leaf(parent)) {
        if (!nodes_[parent].lru_stamp) queue_leaf(parent);
    } else {
        unqueue_leaf(parent);
    }
}

NodeId Tree::split(NodeId id, int64_t pages) {
    const Node& n = nodes_[id];
    int64_t total = pages_of(n);
    if (n.parent == kNone || !n.attached || !(0 < pages && pages < total)) {
        invalid("cannot split an edge of " + std::to_string(total) + " pages after " +
                std::to_string(pages));
    }
    return split_node(id, static_cast<size_t>(pages));
}

std::vector<NodeId> Tree::lru_unlocked(size_t limit) {
    // A merge of the tier-0 heap read in place (its implicit binary tree explored from the
    // top) with inner nodes whose children have all come out, and leaves re-keyed to their
    // real last use: (time, stamp, order, slot, node); inner entries have stamp 0 and a
    // decreasing order, as in the Python tree.
    using Item = std::tuple<double, uint64_t, int64_t, NodeId>;  // slot entries: node = kNone
    std::priority_queue<Item, std::vector<Item>, std::greater<Item>> frontier;
    const auto& h = leaves0_;
    // heap slot entries carry their slot in the third field (>= 0); inner ones are negative
    if (!h.empty()) frontier.emplace(h[0].seen, h[0].stamp, 0, kNone);
    std::unordered_map<NodeId, size_t> yielded_children;
    int64_t inner = 0;
    std::vector<NodeId> out;
    while (!frontier.empty() && out.size() < limit) {
        auto [seen, stamp, slot, id] = frontier.top();
        frontier.pop();
        if (id == kNone) {
            for (int64_t c : {2 * slot + 1, 2 * slot + 2}) {
                if (c < static_cast<int64_t>(h.size())) {
                    frontier.emplace(h[c].seen, h[c].stamp, c, kNone);
                }
            }
            id = h[slot].node;
            if (nodes_[id].lru_stamp != stamp) continue;  // stale
            if (seen != nodes_[id].last_access) {
                frontier.emplace(nodes_[id].last_access, 0, --inner, id);
                continue;
            }
        }
        out.push_back(id);
        NodeId parent = nodes_[id].parent;
        if (parent == kRoot) continue;
        size_t done = ++yielded_children[parent];
        if (done == nodes_[parent].children.size() && nodes_[parent].lock_ref == 0) {
            frontier.emplace(nodes_[parent].last_access, 0, --inner, parent);
        }
    }
    return out;
}

int64_t Tree::repoint(const std::unordered_map<uint64_t, uint64_t>& moved,
                      const std::vector<NodeId>* only) {
    std::vector<NodeId> all;
    if (!only) {
        walk_all(all);
        only = &all;
    }
    int64_t count = 0;
    for (NodeId id : *only) {
        for (uint64_t& addr : nodes_[id].value) {
            auto it = moved.find(addr);
            if (it != moved.end()) {
                addr = it->second;
                count++;
            }
        }
    }
    return count;
}

std::vector<uint64_t> Tree::reset() {
    std::vector<uint64_t> removed;
    std::vector<NodeId> all;
    walk_all(all);
    for (NodeId id : all) {
        Node& n = nodes_[id];
        removed.insert(removed.end(), n.value.begin(), n.value.end());
    }
    for (NodeId id : all) {
        Node& n = nodes_[id];
        if (n.lock_ref) {  // a zombie until its last unlock
            n.attached = false;
            n.lru_stamp = 0;
            n.children.clear();
            n.index.reset();
            n.holders.clear();
        } else {
            free_node(id);
        }
    }
    Node& root = nodes_[kRoot];
    root.children.clear();
    root.index.reset();
    root.collided = false;
    evictable_pages_ = protected_pages_ = 0;
    leaves0_.clear();
    tier_leaves_.clear();
    queued_leaves_ = 0;
    expiry_.clear();
    holder_entries_ = 0;
    for (HolderId h = 0; h < by_holder_.size(); h++) {
        if (by_holder_[h]) {
            by_holder_[h].reset();
            released_.push_back(h);
        }
    }
    return removed;
}

void Tree::set_value(NodeId id, std::vector<uint64_t> value) {
    Node& n = nodes_[id];
    if (n.parent == kNone) invalid("the root has no value");
    size_t want = n.key.size() / ps_ * stride_;
    if (value.size() != want) {
        invalid("expected " + std::to_string(want) + " addresses for this node's " +
                std::to_string(pages_of(n)) + " pages, got " + std::to_string(value.size()));
    }
    n.value = std::move(value);
}

// ------------------------------------------------------------------ structure changes

NodeId Tree::split_node(NodeId child, size_t pages) {
    size_t cut = pages * ps_;
    NodeId upper = alloc();
    Node& u = nodes_[upper];
    Node& c = nodes_[child];
    NodeId parent = c.parent;
    u.key.assign(c.key.begin(), c.key.begin() + cut);
    if (!c.value.empty()) u.value.assign(c.value.begin(), c.value.begin() + pages * stride_);
    u.parent = parent;
    u.holders = c.holders;
    u.lock_ref = c.lock_ref;
    u.last_access = c.last_access;
    u.tier = c.tier;
    replace_child(parent, child, upper);
    c.key.erase(c.key.begin(), c.key.begin() + cut);
    if (!c.value.empty()) c.value.erase(c.value.begin(), c.value.begin() + pages * stride_);
    c.parent = upper;
    u.children.push_back(child);
    if (!u.holders.empty()) {
        for (const HolderSeen& h : u.holders) index_holder(upper, h.holder, h.seen);
        holder_entries_ += static_cast<int64_t>(u.holders.size());
        compact_expiry_if_stale();
    }
    return upper;
}

int64_t Tree::detach(NodeId id, std::vector<uint64_t>* removed) {
    NodeId parent = nodes_[id].parent;
    remove_child(parent, id);
    std::vector<NodeId> sub;
    if (nodes_[id].children.empty()) {
        sub.push_back(id);
    } else {
        subtree(id, sub);
    }
    int64_t total = 0;
    for (NodeId s : sub) {
        Node& n = nodes_[s];
        int64_t pages = pages_of(n);
        total += pages;
        if (n.lock_ref) {
            protected_pages_ -= pages;
        } else {
            evictable_pages_ -= pages;
        }
        if (removed) removed->insert(removed->end(), n.value.begin(), n.value.end());
        n.attached = false;
        if (n.lru_stamp) {
            n.lru_stamp = 0;
            queued_leaves_--;
        }
        if (!n.holders.empty()) {
            for (const HolderSeen& h : n.holders) unindex_holder(s, h.holder);
            holder_entries_ -= static_cast<int64_t>(n.holders.size());
        }
    }
    for (NodeId s : sub) {
        Node& n = nodes_[s];
        if (n.lock_ref) {  // a zombie: kept for the unlock that walks its parents
            n.children.clear();
            n.index.reset();
            n.holders.clear();
        } else {
            free_node(s);
        }
    }
    requeue_if_leaf(parent);
    return total;
}

int64_t Tree::prune(const std::vector<std::pair<NodeId, uint32_t>>& emptied) {
    int64_t pruned = 0;
    for (auto [id, gen] : emptied) {
        if (valid(id, gen) && nodes_[id].attached) pruned += detach(id, nullptr);
    }
    return pruned;
}

// ------------------------------------------------------------------ evictable leaves

std::vector<LeafEntry>& Tree::heap(int32_t tier) {
    return tier == 0 ? leaves0_ : tier_leaves_[tier];
}

size_t Tree::heap_size(int32_t tier) const {
    if (tier == 0) return leaves0_.size();
    auto it = tier_leaves_.find(tier);
    return it == tier_leaves_.end() ? 0 : it->second.size();
}

void Tree::queue_leaf(NodeId id) {
    Node& n = nodes_[id];
    ++seq_;
    if (!n.lru_stamp) queued_leaves_++;
    n.lru_stamp = seq_;
    auto& h = heap(n.tier);
    h.push_back({n.last_access, seq_, id});
    std::push_heap(h.begin(), h.end(), LeafLater());
    if (static_cast<int64_t>(h.size()) > kStaleFactor * queued_leaves_ + kStaleFloor) {
        h.erase(std::remove_if(h.begin(), h.end(),
                               [&](const LeafEntry& e) { return nodes_[e.node].lru_stamp != e.stamp; }),
                h.end());
        std::make_heap(h.begin(), h.end(), LeafLater());
    }
}

void Tree::unqueue_leaf(NodeId id) {
    Node& n = nodes_[id];
    if (n.lru_stamp) {
        n.lru_stamp = 0;
        queued_leaves_--;
    }
}

void Tree::requeue_if_leaf(NodeId id) {
    if (is_tier_leaf(id)) queue_leaf(id);
}

bool Tree::is_tier_leaf(NodeId id) const {
    const Node& n = nodes_[id];
    if (n.parent == kNone || !n.attached || n.lock_ref) return false;
    if (!tiered_) return n.children.empty();
    for (NodeId c : n.children) {
        if (nodes_[c].tier <= n.tier) return false;
    }
    return true;
}

NodeId Tree::pop_lru_leaf(int32_t tier) {
    auto& h = heap(tier);
    while (!h.empty()) {
        std::pop_heap(h.begin(), h.end(), LeafLater());
        LeafEntry e = h.back();
        h.pop_back();
        Node& n = nodes_[e.node];
        if (n.lru_stamp != e.stamp) continue;  // stale
        if (e.seen != n.last_access) {         // used since it was queued: re-enter
            n.lru_stamp = ++seq_;
            h.push_back({n.last_access, n.lru_stamp, e.node});
            std::push_heap(h.begin(), h.end(), LeafLater());
            continue;
        }
        n.lru_stamp = 0;
        queued_leaves_--;
        return e.node;
    }
    return kNone;
}

// ------------------------------------------------------------------ holders

void Tree::confirm(NodeId id, HolderId holder, double now) {
    Node& n = nodes_[id];
    for (HolderSeen& h : n.holders) {
        if (h.holder == holder) {
            h.seen = now;  // its expiry entry, older, is re-keyed when it comes up
            return;
        }
    }
    holder_entries_++;
    n.holders.push_back({holder, now});
    index_holder(id, holder, now);
}

void Tree::index_holder(NodeId id, HolderId holder, double seen) {
    if (holder >= by_holder_.size()) by_holder_.resize(holder + 1);
    if (!by_holder_[holder]) by_holder_[holder] = std::make_unique<std::unordered_set<NodeId>>();
    by_holder_[holder]->insert(id);
    expiry_.push_back({seen, ++seq_, id, nodes_[id].gen, holder});
    std::push_heap(expiry_.begin(), expiry_.end(), ExpiryLater());
}

void Tree::unindex_holder(NodeId id, HolderId holder) {
    if (holder < by_holder_.size() && by_holder_[holder]) {
        by_holder_[holder]->erase(id);
        if (by_holder_[holder]->empty()) {
            by_holder_[holder].reset();
            released_.push_back(holder);
        }
    }
}

void Tree::drop_holder(NodeId id, HolderId holder) {
    Node& n = nodes_[id];
    auto it = std::find_if(n.holders.begin(), n.holders.end(),
                           [&](const HolderSeen& h) { return h.holder == holder; });
    n.holders.erase(it);
    unindex_holder(id, holder);
    holder_entries_--;
}

void Tree::compact_expiry_if_stale() {
    if (static_cast<int64_t>(expiry_.size()) <= kStaleFactor * holder_entries_ + kStaleFloor) {
        return;
    }
    std::set<std::pair<NodeId, HolderId>> kept;
    std::vector<ExpiryEntry> current;
    current.reserve(static_cast<size_t>(holder_entries_));
    for (const ExpiryEntry& e : expiry_) {
        if (!valid(e.node, e.gen) || !nodes_[e.node].attached) continue;
        for (const HolderSeen& h : nodes_[e.node].holders) {
            if (h.holder == e.holder) {
                if (kept.emplace(e.node, e.holder).second) {
                    current.push_back({h.seen, e.seq, e.node, e.gen, e.holder});
                }
                break;
            }
        }
    }
    expiry_ = std::move(current);
    std::make_heap(expiry_.begin(), expiry_.end(), ExpiryLater());
}

// ------------------------------------------------------------------ self-check

void Tree::check() const {
    auto fail = [](const std::string& what) { throw std::logic_error("radix check: " + what); };
    std::vector<NodeId> all;
    subtree(kRoot, all);
    int64_t evictable = 0, prot = 0, queued = 0, pairs = 0;
    std::set<std::pair<HolderId, NodeId>> held;
    std::map<std::pair<NodeId, HolderId>, double> earliest;
    for (const ExpiryEntry& e : expiry_) {
        auto key = std::make_pair(e.node, e.holder);
        auto it = earliest.find(key);
        if (valid(e.node, e.gen) && (it == earliest.end() || e.seen < it->second)) {
            earliest[key] = e.seen;
        }
    }
    std::set<std::pair<NodeId, uint64_t>> entries;
    std::map<std::pair<NodeId, uint64_t>, double> entry_seen;
    auto note = [&](const std::vector<LeafEntry>& h) {
        for (const LeafEntry& e : h) entry_seen[{e.node, e.stamp}] = e.seen;
    };
    note(leaves0_);
    for (const auto& [tier, h] : tier_leaves_) note(h);
    for (NodeId id : all) {
        if (id == kRoot) continue;
        const Node& n = nodes_[id];
        if (!n.live || !n.attached) fail("a detached node is in the tree");
        if (nodes_[n.parent].children.end() ==
            std::find(nodes_[n.parent].children.begin(), nodes_[n.parent].children.end(), id)) {
            fail("a node missing from its parent's children");
        }
        if (n.key.empty() || n.key.size() % ps_) fail("a key that is not whole pages");
        if (stride_ && n.value.size() != n.key.size() / ps_ * stride_) fail("value length");
        (n.lock_ref ? prot : evictable) += pages_of(n);
        if (n.lock_ref < 0) fail("negative lock count");
        for (NodeId c : n.children) {
            if (nodes_[c].lock_ref > n.lock_ref) fail("a child locked more than its parent");
        }
        bool leaf = is_tier_leaf(id);
        if (leaf != (n.lru_stamp != 0)) fail("queued leaves differ from the tier leaves");
        if (n.lru_stamp) {
            queued++;
            auto it = entry_seen.find({id, n.lru_stamp});
            if (it == entry_seen.end()) fail("a queued leaf without its heap entry");
            if (it->second > n.last_access) fail("a heap entry later than its leaf's use");
        }
        for (const HolderSeen& h : n.holders) {
            pairs++;
            held.emplace(h.holder, id);
            auto it = earliest.find({id, h.holder});
            if (it == earliest.end() || it->second > h.seen) fail("a holder without expiry entry");
        }
    }
    if (evictable != evictable_pages_ || prot != protected_pages_) fail("page counts");
    if (queued != queued_leaves_) fail("queued leaf count");
    if (pairs != holder_entries_) fail("holder entry count");
    std::set<std::pair<HolderId, NodeId>> indexed;
    for (HolderId h = 0; h < by_holder_.size(); h++) {
        if (!by_holder_[h]) continue;
        if (by_holder_[h]->empty()) fail("an empty holder set left behind");
        for (NodeId id : *by_holder_[h]) indexed.emplace(h, id);
    }
    if (indexed != held) fail("the holder index differs from the nodes' holders");
}

size_t Tree::memory_bytes() const {
    size_t total = sizeof(Tree) + nodes_.size() * sizeof(Node) + free_.capacity() * 4;
    for (const Node& n : nodes_) {
        total += n.key.capacity() * 4 + n.value.capacity() * 8 + n.children.capacity() * 4 +
                 n.holders.capacity() * sizeof(HolderSeen);
        if (n.index) total += n.index->size() * 32 + n.index->bucket_count() * 8;
    }
    total += (leaves0_.capacity()) * sizeof(LeafEntry);
    for (const auto& [t, h] : tier_leaves_) total += h.capacity() * sizeof(LeafEntry);
    total += expiry_.capacity() * sizeof(ExpiryEntry);
    for (const auto& s : by_holder_) {
        if (s) total += s->size() * 24 + s->bucket_count() * 8;
    }
    return total;
}

}  // namespace radix
