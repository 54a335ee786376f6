#include "ir/printer.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace torch_ext::ir {
namespace {

struct DtypeName {
  c10::ScalarType type;
  const char* short_name;
  const char* torch_name;
};

constexpr DtypeName kDtypes[] = {
    {c10::ScalarType::Float, "f32", "torch.float32"},
    {c10::ScalarType::Double, "f64", "torch.float64"},
    {c10::ScalarType::Half, "f16", "torch.float16"},
    {c10::ScalarType::BFloat16, "bf16", "torch.bfloat16"},
    {c10::ScalarType::Long, "i64", "torch.int64"},
    {c10::ScalarType::Int, "i32", "torch.int32"},
    {c10::ScalarType::Short, "i16", "torch.int16"},
    {c10::ScalarType::Char, "i8", "torch.int8"},
    {c10::ScalarType::Byte, "u8", "torch.uint8"},
    {c10::ScalarType::Bool, "b8", "torch.bool"},
    {c10::ScalarType::ComplexFloat, "c64", "torch.complex64"},
    {c10::ScalarType::ComplexDouble, "c128", "torch.complex128"},
};

const char* layout_name(int64_t v) {
  switch (static_cast<c10::Layout>(v)) {
    case c10::Layout::Strided: return "torch.strided";
    case c10::Layout::Sparse: return "torch.sparse_coo";
    case c10::Layout::SparseCsr: return "torch.sparse_csr";
    default: TORCH_CHECK(false, "layout ", v, " has no text form");
  }
}

const char* memory_format_name(int64_t v) {
  switch (static_cast<c10::MemoryFormat>(v)) {
    case c10::MemoryFormat::Contiguous: return "torch.contiguous_format";
    case c10::MemoryFormat::Preserve: return "torch.preserve_format";
    case c10::MemoryFormat::ChannelsLast: return "torch.channels_last";
    case c10::MemoryFormat::ChannelsLast3d: return "torch.channels_last_3d";
    default: TORCH_CHECK(false, "memory format ", v, " has no text form");
  }
}

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out + "\"";
}

std::string join_ints(const std::vector<int64_t>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? "," : "") + std::to_string(v[i]);
  return out;
}

void print_graph(const Graph& g, const std::string& indent, std::ostringstream& os) {
  os << indent << "graph:\n";
  const std::string body = indent + "  ";
  for (const auto& up : g.nodes()) {
    const Node& n = *up;
    if (n.kind() == NodeKind::Output) {
      os << body << "return (";
      const auto& vals = n.args().at(0).list;
      for (size_t i = 0; i < vals.size(); ++i) os << (i ? ", " : "") << print_arg(vals[i]);
      os << ")\n";
      continue;
    }
    os << body << "%" << n.name() << " : " << print_type(n.type()) << " = ";
    if (n.kind() == NodeKind::Placeholder) {
      os << to_string(n.role()) << "(" << (n.state_name().empty() ? "" : quote(n.state_name())) << ")";
    } else {
      os << n.target().str() << "(";
      bool first = true;
      for (const Arg& a : n.args()) {
        os << (first ? "" : ", ") << print_arg(a);
        first = false;
      }
      for (const auto& kv : n.kwargs()) {
        os << (first ? "" : ", ") << kv.first << "=" << print_arg(kv.second);
        first = false;
      }
      os << ")";
      for (const auto& region : n.regions()) {
        os << " {\n";
        print_graph(*region, body + "  ", os);
        os << body << "}";
      }
    }
    if (!n.module_path().empty()) os << "  # " << n.module_path();
    os << "\n";
  }
}

}  // namespace

namespace {

const DtypeName& dtype_entry(c10::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d;
  TORCH_CHECK(false, "dtype ", c10::toString(t), " has no text form");
}

std::optional<c10::ScalarType> dtype_named(const std::string& s, const char* DtypeName::*field) {
  for (const auto& d : kDtypes)
    if (s == d.*field) return d.type;
  return std::nullopt;
}

}  // namespace

std::string dtype_short_name(c10::ScalarType t) { return dtype_entry(t).short_name; }
std::string dtype_torch_name(c10::ScalarType t) { return dtype_entry(t).torch_name; }
std::optional<c10::ScalarType> dtype_from_short_name(const std::string& s) {
  return dtype_named(s, &DtypeName::short_name);
}
std::optional<c10::ScalarType> dtype_from_torch_name(const std::string& s) {
  return dtype_named(s, &DtypeName::torch_name);
}

std::string format_double(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s = buf;
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

std::string print_type(const Type& t) {
  switch (t.kind) {
    case Type::Kind::Tensor: {
      std::string s = dtype_short_name(t.tensor.dtype) + "[" + join_ints(t.tensor.sizes) + "]";
      if (!t.tensor.is_contiguous()) s += "{" + join_ints(t.tensor.strides) + "}";
      if (t.tensor.device.type() != c10::kCPU) s += "@" + t.tensor.device.str();
      return s;
    }
    case Type::Kind::Tuple: {
      std::string s = "(";
      for (size_t i = 0; i < t.elems.size(); ++i) s += (i ? ", " : "") + print_type(t.elems[i]);
      return s + ")";
    }
    case Type::Kind::Int: return "int";
    case Type::Kind::Float: return "float";
    case Type::Kind::Bool: return "bool";
    case Type::Kind::None: return "none";
  }
  return "?";
}

std::string print_arg(const Arg& a) {
  switch (a.kind) {
    case Arg::Kind::None: return "None";
    case Arg::Kind::Node: return "%" + a.node->name();
    case Arg::Kind::Int: return std::to_string(a.i);
    case Arg::Kind::Float: return format_double(a.f);
    case Arg::Kind::Bool: return a.i ? "True" : "False";
    case Arg::Kind::String: return quote(a.s);
    case Arg::Kind::List: {
      std::string s = "[";
      for (size_t i = 0; i < a.list.size(); ++i) s += (i ? ", " : "") + print_arg(a.list[i]);
      return s + "]";
    }
    case Arg::Kind::Dtype: return dtype_torch_name(static_cast<c10::ScalarType>(a.i));
    case Arg::Kind::Device: return "device(" + quote(a.s) + ")";
    case Arg::Kind::Layout: return layout_name(a.i);
    case Arg::Kind::MemoryFormat: return memory_format_name(a.i);
  }
  return "?";
}

std::string print(const Graph& graph) {
  std::ostringstream os;
  print_graph(graph, "", os);
  return os.str();
}

}  // namespace torch_ext::ir
