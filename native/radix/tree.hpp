// The page radix tree's core: plain C++, no Python. Holders are small ints (the binding maps
// Python objects to them), times are doubles (the binding reads the clock), and every error is
// a TreeError the binding turns into a Python exception.
//
// Nodes live in a deque (stable addresses) and are named by index; a freed index is reused
// with its generation bumped, so a handle (index, generation) taken before the free is
// recognised as stale instead of reaching another node. A node detached while locked stays
// allocated (a "zombie") until its last unlock, so that unlock can still walk its parents.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace radix {

using NodeId = uint32_t;
using HolderId = uint32_t;
constexpr NodeId kNone = UINT32_MAX;
constexpr NodeId kRoot = 0;

enum class ErrorKind { InvalidRequest, BlockInUse, StaleNode };

struct TreeError : std::runtime_error {
    ErrorKind kind;
    TreeError(ErrorKind k, const std::string& msg) : std::runtime_error(msg), kind(k) {}
};

struct HolderSeen {
    HolderId holder;
    double seen;
};

struct Node {
    std::vector<uint32_t> key;      // whole pages of token ids
    std::vector<uint64_t> value;    // stride addresses per page (empty in a holders-only tree)
    std::vector<NodeId> children;   // in insertion order (Python dict order)
    std::unique_ptr<std::unordered_map<uint64_t, NodeId>> index;  // first-page hash -> child
    std::vector<HolderSeen> holders;  // in insertion order; empty means None
    NodeId parent = kNone;
    uint32_t gen = 0;
    int32_t lock_ref = 0;
    int32_t tier = 0;
    double last_access = 0.0;
    uint64_t lru_stamp = 0;  // stamp of its current leaf-heap entry; 0: none
    bool attached = false;
    bool live = false;      // allocated (attached, or a locked zombie)
    bool collided = false;  // two first pages hashed alike: look children up by scan
};

struct LeafEntry {
    double seen;
    uint64_t stamp;
    NodeId node;
};

struct ExpiryEntry {
    double seen;
    uint64_t seq;
    NodeId node;
    uint32_t gen;
    HolderId holder;
};

struct Removed {
    std::vector<uint64_t> values;
    int64_t pages = 0;
};

struct InsertOut {
    int64_t existing_tokens = 0;
    int64_t new_tokens = 0;
    std::vector<uint64_t> duplicates;
    NodeId node = kRoot;
};

struct MatchOut {
    int64_t num_tokens = 0;
    std::vector<uint64_t> value;
    NodeId node = kRoot;
    std::vector<std::pair<HolderId, int64_t>> holder_tokens;  // first-seen order
};

class Tree {
  public:
    Tree(uint32_t page_size, uint32_t stride);

    uint32_t page_size() const { return ps_; }
    uint32_t stride() const { return stride_; }
    int64_t evictable_pages() const { return evictable_pages_; }
    int64_t protected_pages() const { return protected_pages_; }

    // Tokens are whole pages (the binding truncates); `values` has stride per page or is null.
    MatchOut match(const uint32_t* key, size_t n, double now, const double* cutoff, bool split);
    void holders(const uint32_t* key, size_t n, double now, double cutoff,
                 std::vector<std::pair<HolderId, int64_t>>& out);
    InsertOut insert(const uint32_t* key, size_t n, const uint64_t* values, HolderId holder,
                     int32_t tier, double now);
    std::vector<uint64_t> erase(const uint32_t* key, size_t n);
    Removed evict(int64_t num_pages, int32_t tier);
    void lock(NodeId node);
    void unlock(NodeId node);
    int64_t remove_holder_everywhere(HolderId holder);
    int64_t remove_holder_on_path(HolderId holder, const uint32_t* key, size_t n, int64_t keep);
    int64_t expire(double older_than);
    NodeId lru_leaf(int32_t tier);
    void set_tier(NodeId node, int32_t tier);
    NodeId split(NodeId node, int64_t pages);
    std::vector<NodeId> lru_unlocked(size_t limit);
    int64_t repoint(const std::unordered_map<uint64_t, uint64_t>& moved,
                    const std::vector<NodeId>* only);
    std::vector<uint64_t> reset();
    std::vector<NodeId> nodes();  // every attached node but the root, parents first
    void set_value(NodeId node, std::vector<uint64_t> value);

    // Handles: a node index plus its generation.
    const Node& node(NodeId id) const { return nodes_[id]; }
    bool valid(NodeId id, uint32_t gen) const {
        return id < nodes_.size() && nodes_[id].live && nodes_[id].gen == gen;
    }
    void check_handle(NodeId id, uint32_t gen) const;
    NodeId find_child(NodeId parent, const uint32_t* page) const;

    // Holders whose last node went: the binding forgets their Python objects.
    std::vector<HolderId>& released_holders() { return released_; }
    bool holds_any(HolderId h) const {
        return h < by_holder_.size() && by_holder_[h] && !by_holder_[h]->empty();
    }

    // White-box access for the tests (sizes of the lazy structures, whole-tree walks).
    size_t heap_size(int32_t tier) const;
    size_t expiry_size() const { return expiry_.size(); }
    int64_t queued_leaves() const { return queued_leaves_; }
    int64_t holder_entries() const { return holder_entries_; }
    uint64_t full_walks() const { return full_walks_; }
    size_t live_nodes() const { return nodes_.size() - free_.size(); }
    // Every incremental structure against a scan of the tree; throws std::logic_error.
    void check() const;
    size_t memory_bytes() const;

  private:
    uint32_t ps_, stride_;
    std::deque<Node> nodes_;
    std::vector<NodeId> free_;
    int64_t evictable_pages_ = 0, protected_pages_ = 0;
    uint64_t seq_ = 0;
    std::vector<LeafEntry> leaves0_;
    std::unordered_map<int32_t, std::vector<LeafEntry>> tier_leaves_;
    int64_t queued_leaves_ = 0;
    bool tiered_ = false;
    std::vector<ExpiryEntry> expiry_;
    int64_t holder_entries_ = 0;
    std::vector<std::unique_ptr<std::unordered_set<NodeId>>> by_holder_;
    std::vector<HolderId> released_;
    uint64_t full_walks_ = 0;

    NodeId alloc();
    void free_node(NodeId id);
    uint64_t page_hash(const uint32_t* page) const;
    void add_child(NodeId parent, NodeId child);
    void remove_child(NodeId parent, NodeId child);
    void replace_child(NodeId parent, NodeId old_child, NodeId new_child);
    void build_index(NodeId parent);

    std::pair<NodeId, size_t> descend(const uint32_t* key, size_t n, bool split,
                                      const double* now);
    size_t common_pages(const Node& edge, const uint32_t* key, size_t remaining) const;
    bool edge_is_prefix(const Node& edge, const uint32_t* key, size_t remaining) const;
    size_t depth(NodeId node) const;
    NodeId split_node(NodeId child, size_t pages);
    int64_t detach(NodeId node, std::vector<uint64_t>* removed);
    int64_t prune(const std::vector<std::pair<NodeId, uint32_t>>& emptied);
    void subtree(NodeId start, std::vector<NodeId>& out) const;
    void walk_all(std::vector<NodeId>& out);

    std::vector<LeafEntry>& heap(int32_t tier);
    void queue_leaf(NodeId id);
    void unqueue_leaf(NodeId id);
    void requeue_if_leaf(NodeId id);
    bool is_tier_leaf(NodeId id) const;
    NodeId pop_lru_leaf(int32_t tier);

    void confirm(NodeId id, HolderId holder, double now);
    void index_holder(NodeId id, HolderId holder, double seen);
    void unindex_holder(NodeId id, HolderId holder);
    void drop_holder(NodeId id, HolderId holder);
    void compact_expiry_if_stale();
    int64_t pages_of(const Node& n) const { return static_cast<int64_t>(n.key.size() / ps_); }
};

}  // namespace radix
