// CPU graphs: a recorded sequence of dispatcher calls, replayed from C++ (see backends/cpu/graph.py).
//
// An OpGraph holds numbered tensor slots and a list of nodes. A node is one operator (found once by
// name in the dispatcher) with its argument list: constants converted once, at recording, to the
// IValues of the operator's schema, and tensor arguments that name slots. Slots are filled by binding
// (tensors that outlive the graph: weights, the KV cache, the static input buffers) or by the outputs
// of earlier nodes; a slot is emptied after its last reader, so intermediate memory is returned as a
// replay goes, as in the eager run. replay() runs every node through the boxed dispatcher without the
// GIL and copies the graph's results into the tensors captured as its outputs.
#include <torch/extension.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>

#include <chrono>
#include <string>
#include <vector>

namespace {

struct Arg {
  enum class Kind { kConstant, kSlot, kSlotList };
  Kind kind = Kind::kConstant;
  c10::IValue constant;         // kConstant
  std::vector<int64_t> slots;   // kSlot (one entry) or kSlotList (-1: None in a Tensor?[] list)
  bool optional_elements = false;  // kSlotList: the schema's list holds Tensor? (e.g. aten::index)
};

struct Node {
  c10::OperatorHandle op;
  std::vector<Arg> args;
  std::vector<int64_t> outputs;  // one slot per returned tensor, lists flattened; -1: not kept
  std::vector<int64_t> release;  // slots whose last reader is this node
};

class OpGraph {
 public:
  explicit OpGraph(int64_t num_slots) : slots_(num_slots), pinned_(num_slots, false) {}

  // A tensor that outlives the graph (a weight, the KV cache, a static input); kept across replays.
  void bind(int64_t slot, const at::Tensor& tensor) {
    check_slot(slot);
    slots_[slot] = tensor;
    pinned_[slot] = true;
  }

  // args: one (kind, value) pair per schema argument, in schema order: ("c", python value), ("t", slot)
  // or ("l", [slot or -1, ...]).
  void add_node(const std::string& name, const std::string& overload, const py::list& args,
                std::vector<int64_t> outputs, std::vector<int64_t> release) {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const auto& schema = op.schema();
    TORCH_CHECK(args.size() == schema.arguments().size(), "OpGraph: ", name, " takes ",
                schema.arguments().size(), " arguments, the recording gives ", args.size());
    Node node{op, {}, std::move(outputs), std::move(release)};
    for (size_t i = 0; i < args.size(); ++i) {
      const auto pair = args[i].cast<py::tuple>();
      const auto kind = pair[0].cast<std::string>();
      const auto& argument = schema.arguments()[i];
      Arg arg;
      if (kind == "c" && argument.type()->kind() == c10::TypeKind::TensorType) {
        // A Python number where the schema takes a Tensor (``x + 1``): a wrapped-number tensor, as
        // torch's argument parser makes, so that type promotion treats it as a scalar.
        at::Tensor number = at::scalar_to_tensor(torch::jit::toIValue(pair[1], c10::NumberType::get()).toScalar());
        number.unsafeGetTensorImpl()->set_wrapped_number(true);
        arg.constant = number;
      } else if (kind == "c") {
        arg.constant = torch::jit::toIValue(pair[1], argument.real_type(), argument.N());
      } else if (kind == "t") {
        arg.kind = Arg::Kind::kSlot;
        arg.slots.push_back(check_slot(pair[1].cast<int64_t>()));
      } else if (kind == "l") {
        arg.kind = Arg::Kind::kSlotList;
        for (auto slot : pair[1].cast<std::vector<int64_t>>()) arg.slots.push_back(slot < 0 ? -1 : check_slot(slot));
        const auto list = argument.real_type()->cast<c10::ListType>();
        TORCH_CHECK(list, "OpGraph: ", name, " argument ", argument.name(), " is not a list");
        arg.optional_elements = list->getElementType()->kind() == c10::TypeKind::OptionalType;
      } else {
        TORCH_CHECK(false, "OpGraph: unknown argument kind '", kind, "'");
      }
      node.args.push_back(std::move(arg));
    }
    for (auto slot : node.outputs)
      if (slot >= 0) check_slot(slot);
    for (auto slot : node.release) check_slot(slot);
    nodes_.push_back(std::move(node));
  }

  // The graph's results: after each replay, slot ``slots[i]`` is copied into ``targets[i]``.
  void set_outputs(std::vector<int64_t> slots, std::vector<at::Tensor> targets) {
    TORCH_CHECK(slots.size() == targets.size(), "OpGraph: one target per output slot");
    for (auto slot : slots) check_slot(slot);
    output_slots_ = std::move(slots);
    output_targets_ = std::move(targets);
  }

  void replay() { run(nullptr); }

  // A replay that also returns each node's wall time in seconds (where a step's time goes).
  std::vector<double> replay_timed() {
    std::vector<double> seconds(nodes_.size());
    run(seconds.data());
    return seconds;
  }

  int64_t num_nodes() const { return static_cast<int64_t>(nodes_.size()); }

  std::string node_name(int64_t i) const {
    TORCH_CHECK(i >= 0 && i < num_nodes(), "OpGraph: node ", i, " outside [0, ", num_nodes(), ")");
    const auto& schema = nodes_[i].op.schema();
    return schema.overload_name().empty() ? schema.name() : schema.name() + "." + schema.overload_name();
  }

  // Intermediate tensors the graph holds now (0 between replays).
  int64_t held() const {
    int64_t n = 0;
    for (size_t i = 0; i < slots_.size(); ++i) n += !pinned_[i] && slots_[i].defined();
    return n;
  }

 private:
  void run(double* seconds) {
    py::gil_scoped_release no_gil;
    c10::InferenceMode inference;
    torch::jit::Stack stack;
    try {
      for (size_t i = 0; i < nodes_.size(); ++i) {
        const Node& node = nodes_[i];
        const auto start = seconds ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
        stack.clear();
        for (const auto& arg : node.args) push(stack, arg);
        node.op.callBoxed(stack);
        size_t k = 0;
        for (auto& value : stack) {
          if (value.isTensor()) {
            store(node, k++, value.toTensor());
          } else if (value.isTensorList()) {
            for (const at::Tensor& t : value.toTensorList()) store(node, k++, t);
          } else if (value.isNone()) {
            ++k;
          } else {
            TORCH_CHECK(false, "OpGraph: ", node.op.schema().name(), " returned a non-tensor value");
          }
        }
        for (auto slot : node.release) slots_[slot] = at::Tensor();
        if (seconds)
          seconds[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
      for (size_t i = 0; i < output_slots_.size(); ++i) output_targets_[i].copy_(slots_[output_slots_[i]]);
    } catch (...) {
      clear();
      throw;
    }
    clear();
  }

  int64_t check_slot(int64_t slot) const {
    TORCH_CHECK(slot >= 0 && slot < static_cast<int64_t>(slots_.size()), "OpGraph: slot ", slot,
                " outside [0, ", slots_.size(), ")");
    return slot;
  }

  void push(torch::jit::Stack& stack, const Arg& arg) const {
    switch (arg.kind) {
      case Arg::Kind::kConstant:
        stack.push_back(arg.constant);
        return;
      case Arg::Kind::kSlot:
        stack.emplace_back(slots_[arg.slots[0]]);
        return;
      case Arg::Kind::kSlotList:
        if (arg.optional_elements) {
          c10::List<std::optional<at::Tensor>> list;
          list.reserve(arg.slots.size());
          for (auto slot : arg.slots)
            list.push_back(slot < 0 ? std::optional<at::Tensor>() : std::optional<at::Tensor>(slots_[slot]));
          stack.emplace_back(std::move(list));
        } else {
          c10::List<at::Tensor> list;
          list.reserve(arg.slots.size());
          for (auto slot : arg.slots) list.push_back(slots_[slot]);
          stack.emplace_back(std::move(list));
        }
        return;
    }
  }

  void store(const Node& node, size_t k, const at::Tensor& tensor) {
    TORCH_CHECK(k < node.outputs.size(), "OpGraph: ", node.op.schema().name(),
                " returned more tensors than it did when recorded");
    if (node.outputs[k] >= 0) slots_[node.outputs[k]] = tensor;
  }

  // Drops every intermediate: between replays the graph holds only its bound tensors.
  void clear() {
    for (size_t i = 0; i < slots_.size(); ++i)
      if (!pinned_[i]) slots_[i] = at::Tensor();
  }

  std::vector<at::Tensor> slots_;
  std::vector<bool> pinned_;
  std::vector<Node> nodes_;
  std::vector<int64_t> output_slots_;
  std::vector<at::Tensor> output_targets_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<OpGraph>(m, "OpGraph")
      .def(py::init<int64_t>(), py::arg("num_slots"))
      .def("bind", &OpGraph::bind, py::arg("slot"), py::arg("tensor"))
      .def("add_node", &OpGraph::add_node, py::arg("name"), py::arg("overload"), py::arg("args"),
           py::arg("outputs"), py::arg("release"))
      .def("set_outputs", &OpGraph::set_outputs, py::arg("slots"), py::arg("targets"))
      .def("replay", &OpGraph::replay)
      .def("replay_timed", &OpGraph::replay_timed)
      .def("node_name", [](const OpGraph& g, int64_t i) { return g.node_name(i); }, py::arg("index"))
      .def_property_readonly("num_nodes", &OpGraph::num_nodes)
      .def_property_readonly("held", &OpGraph::held);
}
