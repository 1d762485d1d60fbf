"""Kubernetes' CEL on cel-python, as DRA device selectors and admission policies see it:
resource.Quantity values and the Kubernetes quantity library (quantity(), isQuantity(),
compareTo, isGreaterThan, ...), used by the scheduler stand-in (tests/helpers/k8s/controllers.py)
and the claim-caps ValidatingAdmissionPolicy test (tests/k8s/test_k8s_install.py).  DRA/ below
is kubernetes/kubernetes staging/src/k8s.io/dynamic-resource-allocation/.
"""
from decimal import Decimal, localcontext

from tests.helpers.k8s.defaults import canonical, parse


# === quantities ===

class Quantity:
    """A resource.Quantity: its exact value and the format (from its suffix) it is written in;
    str() gives what the API server stores (helpers.k8s.defaults.canonical)."""
    __slots__ = ("value", "form")

    def __init__(self, value, form="DecimalSI"):
        self.value, self.form = Decimal(value), form

    @classmethod
    def parse(cls, text):
        return cls(*parse(text))

    def whole(self) -> int:
        """Quantity.Value(): rounded up to an integer."""
        return int(self.value.to_integral_value(rounding="ROUND_CEILING"))

    def __str__(self):
        with localcontext() as ctx:
            ctx.prec = 80
            if self.form == "BinarySI":     # exact: a power of two divides into a finite decimal
                return canonical(f"{self.value / 1024:f}Ki")
            return canonical(f"{self.value:f}" + ("e0" if self.form == "DecimalExponent" else ""))

    def __repr__(self):
        return f"Quantity({str(self)!r})"


# === CEL, as DRA/cel/compile.go sets it up (v1.34.0 to v1.37 alike) ===
# The device is {driver, allowMultipleAllocations, attributes, capacity}; attributes and
# capacity are maps by domain (a name without one is the driver's) whose lookup of a missing
# domain gives an empty map; a missing attribute is a runtime error.  An attribute is an
# int, bool or string (a version attribute is a semver.Version there: a string here); a
# capacity is a Quantity, with the functions of k8s.io/apiserver/pkg/cel/library/quantity.go
# (k8s.io/apiserver v0.34.0 to master alike), in the base environment since 1.28
# (k8s.io/apiserver/pkg/cel/environment/base.go).  A Quantity has no operators but ==, !=
# and `in`: `capacity.memory > 1000` is a compile error there, a CelError here when
# evaluated.  A compile or runtime error fails the allocation (DRA/structured/internal/*/
# allocator_*.go selectorsMatch returns it): the claim is not allocated.

class CelError(Exception):
    """A selector's CEL compile or runtime error (the allocator's error: not allocated)."""


_QUANTITY_ONLY_GLOBAL = {"quantity", "isQuantity", "sign"}        # cel.Overload
_QUANTITY_METHODS = {"isGreaterThan", "isLessThan", "compareTo", "asApproximateFloat", "asInteger",
                     "isInteger", "add", "sub"}                     # cel.MemberOverload
_PROGRAMS = {}


def _cel():
    import celpy
    from celpy import celtypes
    from celpy.evaluation import base_functions
    return celpy, celtypes, base_functions


def _no_overload(name, *args):
    """A type error: CEL's type check finds it at compile time, celpy when it evaluates."""
    return CelError(f"CEL compile error: found no matching overload for '{name}' applied to "
                    f"({', '.join(type(a).__name__ for a in args)})")


def _quantities(name, *args):
    if not all(isinstance(a, Quantity) for a in args):
        raise _no_overload(name, *args)


def functions() -> dict:
    """The functions of a CEL program: the standard ones made strict about Quantities, and the
    Kubernetes quantity library."""
    _, celtypes, base = _cel()

    def compare(name):
        def call(a, b):
            _quantities(name, a, b)
            return (a.value > b.value) - (a.value < b.value)
        return call

    def integer(q):
        """AsInt64: whole and within int64, else None."""
        whole = q.value == q.value.to_integral_value() and -(1 << 63) <= q.value < (1 << 63)
        return int(q.value) if whole else None

    def as_integer(q):
        _quantities("asInteger", q)
        if integer(q) is None:
            raise ValueError("cannot convert value to integer")     # a runtime error
        return celtypes.IntType(integer(q))

    def quantity(s):
        if not isinstance(s, str):
            raise _no_overload("quantity", s)
        return Quantity.parse(s)                    # a string that is none: a runtime error

    def is_quantity(s):
        if not isinstance(s, str):
            raise _no_overload("isQuantity", s)
        try:
            Quantity.parse(s)
        except ValueError:
            return celtypes.BoolType(False)
        return celtypes.BoolType(True)

    def arithmetic(name, sign):
        """add/sub: a Quantity, or an int (resource.NewQuantity(n, DecimalExponent))."""
        def call(q, other):
            _quantities(name, q)
            if isinstance(other, Quantity):
                return Quantity(q.value + sign * other.value, q.form)
            if isinstance(other, int) and not isinstance(other, celtypes.BoolType):
                return Quantity(q.value + sign * int(other), q.form)
            raise _no_overload(name, q, other)
        return call

    def strict(name, fn):
        """The standard functions and operators: a Quantity is no operand of any but ==, !=
        and `in` (a list of Quantities)."""
        def call(*args):
            if name == "_in_" and isinstance(args[0], Quantity) and isinstance(args[1], list):
                _quantities(name, *args[:1], *args[1])
                return celtypes.BoolType(any(args[0].value == q.value for q in args[1]))
            if any(isinstance(a, Quantity) for a in args):
                if name not in ("_==_", "_!=_"):
                    raise _no_overload(name, *args)
                _quantities(name, *args)
                return celtypes.BoolType((args[0].value == args[1].value) == (name == "_==_"))
            return fn(*args)
        return call

    def unary(name, fn):
        def call(q):
            _quantities(name, q)
            return fn(q)
        return call

    out = {name: strict(name, fn) for name, fn in base.items() if name not in ("type", "_?_:_")}
    out.update({
        "quantity": quantity,
        "isQuantity": is_quantity,
        "sign": unary("sign", lambda q: celtypes.IntType((q.value > 0) - (q.value < 0))),
        "compareTo": lambda a, b: celtypes.IntType(compare("compareTo")(a, b)),
        "isGreaterThan": lambda a, b: celtypes.BoolType(compare("isGreaterThan")(a, b) > 0),
        "isLessThan": lambda a, b: celtypes.BoolType(compare("isLessThan")(a, b) < 0),
        "asApproximateFloat": unary("asApproximateFloat", lambda q: celtypes.DoubleType(float(q.value))),
        "asInteger": as_integer,
        "isInteger": unary("isInteger", lambda q: celtypes.BoolType(integer(q) is not None)),
        "add": arithmetic("add", 1),
        "sub": arithmetic("sub", -1),
    })
    return out


def _program(expression):
    """The compiled selector (cached, as the allocator's CEL cache does)."""
    if expression not in _PROGRAMS:
        celpy, _, _ = _cel()
        env = celpy.Environment()
        try:
            ast = env.compile(expression)
        except Exception as e:                     # CELParseError and lark's own
            raise CelError(f"CEL compile error: {e}") from e
        for node in ast.iter_subtrees():           # celpy calls f(x) and x.f() alike; CEL does not
            if node.data == "member_dot_arg" and str(node.children[1]) in _QUANTITY_ONLY_GLOBAL or \
                    node.data == "ident_arg" and str(node.children[0]) in _QUANTITY_METHODS:
                name = str(node.children[1 if node.data == "member_dot_arg" else 0])
                raise CelError(f"CEL compile error: found no matching overload for '{name}' in {expression!r}")
        _PROGRAMS[expression] = env.program(ast, functions=functions())
    return _PROGRAMS[expression]


def cel_device(driver, dev):
    """A ResourceSlice device as a DRA selector sees it (`device`)."""
    celpy, celtypes, _ = _cel()

    class ByDomain(celtypes.MapType):
        def __getitem__(self, key):
            return super().__getitem__(key) if key in self else celtypes.MapType()

    kinds = {"int": celtypes.IntType, "bool": celtypes.BoolType, "string": celtypes.StringType,
             "version": celtypes.StringType}
    s = celtypes.StringType
    attrs, caps = {}, {}
    for name, value in (dev.get("attributes") or {}).items():
        domain, short = name.split("/", 1) if "/" in name else (driver, name)     # parseQualifiedName
        [(kind, v)] = value.items()
        attrs.setdefault(domain, celtypes.MapType())[s(short)] = kinds[kind](v)
    for name, value in (dev.get("capacity") or {}).items():
        domain, short = name.split("/", 1) if "/" in name else (driver, name)
        caps.setdefault(domain, celtypes.MapType())[s(short)] = Quantity.parse(value["value"])
    return celtypes.MapType({
        s("driver"): s(driver),
        s("allowMultipleAllocations"): celtypes.BoolType(bool(dev.get("allowMultipleAllocations"))),
        s("attributes"): ByDomain({s(k): v for k, v in attrs.items()}),
        s("capacity"): ByDomain({s(k): v for k, v in caps.items()})})


def matches(expression, device) -> bool:
    """Whether the selector holds for the device; CelError on a compile or runtime error."""
    celpy, celtypes, _ = _cel()
    try:
        result = _program(expression).evaluate({"device": device})
    except CelError:
        raise
    except Exception as e:                         # celpy.CELEvalError and the like
        raise CelError(f"CEL runtime error: {e}") from e
    if not isinstance(result, celtypes.BoolType):
        raise CelError(f"CEL result of type {type(result).__name__} is no bool: {expression!r}")
    return bool(result)
