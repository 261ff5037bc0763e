//! Value types and conversions: `NetAddr` and `MrDesc` (bytes-convertible, picklable), the
//! config dict → TOML conversion, page-index and byte extraction, `expected_arrivals`.

use pyo3::buffer::{PyBuffer, PyUntypedBuffer};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::errors;

/// A peer's address (its main NIC), as bytes: `bytes(addr)`, `NetAddr(b)`; picklable.
#[pyclass(module = "xfer", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) struct NetAddr(pub(crate) engine_core::NetAddr);

#[pymethods]
impl NetAddr {
    #[new]
    fn new(py: Python<'_>, raw: &Bound<'_, PyAny>) -> PyResult<Self> {
        let bytes = bytes_of(raw)?;
        engine_core::NetAddr::from_bytes(&bytes)
            .map(Self)
            .map_err(|source| {
                errors::to_py(
                    py,
                    engine_core::Error::Decode {
                        what: "NetAddr",
                        source,
                    },
                )
            })
    }

    fn __bytes__<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.0.to_bytes())
    }

    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyBytes>,))> {
        let py = slf.py();
        Ok((py.get_type::<Self>().into_any(), (slf.get().__bytes__(py),)))
    }

    fn __repr__(&self) -> String {
        format!("xfer.NetAddr({})", self.0)
    }
}

/// A registered region as a peer addresses it (pointer, length, one key per NIC). Send it to
/// the peers that write into or read from the region: `bytes(desc)`, `MrDesc(b)`; picklable.
#[pyclass(module = "xfer", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) struct MrDesc(pub(crate) engine_core::MrDesc);

#[pymethods]
impl MrDesc {
    #[new]
    pub(crate) fn new(py: Python<'_>, raw: &Bound<'_, PyAny>) -> PyResult<Self> {
        let bytes = bytes_of(raw)?;
        engine_core::MrDesc::from_bytes(&bytes)
            .map(Self)
            .map_err(|source| {
                errors::to_py(
                    py,
                    engine_core::Error::Decode {
                        what: "MrDesc",
                        source,
                    },
                )
            })
    }

    /// The region's first byte (in the owner's address space).
    #[getter]
    fn ptr(&self) -> u64 {
        self.0.ptr()
    }

    /// The region's length in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.0.len()
    }

    /// The owner's main address.
    #[getter]
    fn owner(&self) -> NetAddr {
        NetAddr(self.0.owner().clone())
    }

    /// The owner's NIC addresses that hold keys for the region (the senders of its owner's
    /// writes, for `restrict_imm_senders`).
    #[getter]
    fn nics(&self) -> Vec<NetAddr> {
        self.0
            .rkeys()
            .iter()
            .map(|(nic, _)| NetAddr(nic.clone()))
            .collect()
    }

    fn __len__(&self) -> usize {
        self.0.len() as usize
    }

    fn __bytes__<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.0.to_bytes())
    }

    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyBytes>,))> {
        let py = slf.py();
        Ok((py.get_type::<Self>().into_any(), (slf.get().__bytes__(py),)))
    }

    fn __repr__(&self) -> String {
        format!(
            "xfer.MrDesc(ptr={:#x}, nbytes={}, owner={})",
            self.0.ptr(),
            self.0.len(),
            self.0.owner()
        )
    }
}

/// The bytes of any bytes-like object (bytes, bytearray, memoryview, contiguous arrays).
pub(crate) fn bytes_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    let py = obj.py();
    let not_bytes = || {
        errors::invalid(
            py,
            format!("expected a bytes-like object, not {}", type_name(obj)),
        )
    };
    let buf = PyUntypedBuffer::get(obj).map_err(|_| not_bytes())?;
    if !buf.is_c_contiguous() {
        return Err(errors::invalid(py, "the buffer is not contiguous"));
    }
    if let Ok(b) = PyBuffer::<u8>::get(obj) {
        return b.to_vec(py);
    }
    // Wider items (e.g. a numpy int array): their raw bytes, through a byte view.
    let view = py
        .import("builtins")?
        .getattr("memoryview")?
        .call1((obj,))?
        .call_method1("cast", ("B",))?;
    PyBuffer::<u8>::get(&view)?.to_vec(py)
}

pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string())
}

/// Integers from any int sequence or an integer array (read without a Python loop when it
/// is a buffer of 32- or 64-bit integers), each converted to `T`; `what` names them in errors.
fn ints_of<T: TryFrom<i128>>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<T>> {
    let py = obj.py();
    let convert = |v: i128| {
        T::try_from(v)
            .map_err(|_| errors::invalid(py, format!("{what} {v} is negative or too large")))
    };
    fn all<T, V: Into<i128> + Copy>(
        values: Vec<V>,
        convert: impl Fn(i128) -> PyResult<T>,
    ) -> PyResult<Vec<T>> {
        values.into_iter().map(|v| convert(v.into())).collect()
    }
    if let Ok(b) = PyBuffer::<u32>::get(obj) {
        return all(b.to_vec(py)?, convert);
    }
    if let Ok(b) = PyBuffer::<i32>::get(obj) {
        return all(b.to_vec(py)?, convert);
    }
    if let Ok(b) = PyBuffer::<i64>::get(obj) {
        return all(b.to_vec(py)?, convert);
    }
    if let Ok(b) = PyBuffer::<u64>::get(obj) {
        return all(b.to_vec(py)?, convert);
    }
    let iter = obj.try_iter().map_err(|_| {
        errors::invalid(
            py,
            format!(
                "{what} must be a sequence of ints or an integer array, not {}",
                type_name(obj)
            ),
        )
    })?;
    iter.map(|item| {
        let item = item?;
        let v: i128 = item.extract().map_err(|_| {
            errors::invalid(py, format!("{what} must be ints, not {}", type_name(&item)))
        })?;
        convert(v)
    })
    .collect()
}

/// Page indices (any int sequence or integer numpy array).
pub(crate) fn indices_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    ints_of(obj, "page index")
}

/// Byte counts or offsets: an int (standing for `n` copies of itself) or what `ints_of`
/// takes.
pub(crate) fn u64s_of(obj: &Bound<'_, PyAny>, what: &str, n: Option<usize>) -> PyResult<Vec<u64>> {
    if let (Ok(v), Some(n)) = (obj.extract::<u64>(), n) {
        return Ok(vec![v; n]);
    }
    ints_of(obj, what)
}

/// A Python config dict as TOML text (the engine parses and checks it like a file).
pub(crate) fn toml_of_dict(dict: &Bound<'_, PyDict>) -> PyResult<String> {
    let table = table_of(dict)?;
    toml::to_string(&table).map_err(|e| errors::raise(dict.py(), "ConfigError", e.to_string()))
}

fn table_of(dict: &Bound<'_, PyDict>) -> PyResult<toml::Table> {
    let mut table = toml::Table::new();
    for (k, v) in dict.iter() {
        let key: String = k.extract().map_err(|_| {
            errors::raise(
                dict.py(),
                "ConfigError",
                format!("config keys are strings, not {}", type_name(&k)),
            )
        })?;
        let value = value_of(&v).map_err(|e| {
            errors::raise(dict.py(), "ConfigError", format!("config key `{key}`: {e}"))
        })?;
        table.insert(key, value);
    }
    Ok(table)
}

fn value_of(v: &Bound<'_, PyAny>) -> Result<toml::Value, String> {
    if v.is_instance_of::<PyBool>() {
        return Ok(toml::Value::Boolean(
            v.extract().map_err(|e| format!("{e}"))?,
        ));
    }
    if v.is_instance_of::<PyInt>() {
        return v
            .extract::<i64>()
            .map(toml::Value::Integer)
            .map_err(|e| format!("{e}"));
    }
    if v.is_instance_of::<PyFloat>() {
        return v
            .extract::<f64>()
            .map(toml::Value::Float)
            .map_err(|e| format!("{e}"));
    }
    if v.is_instance_of::<PyString>() {
        return v
            .extract::<String>()
            .map(toml::Value::String)
            .map_err(|e| format!("{e}"));
    }
    if let Ok(d) = v.cast::<PyDict>() {
        return table_of(d)
            .map(toml::Value::Table)
            .map_err(|e| e.to_string());
    }
    if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        let items: Result<Vec<_>, String> = v
            .try_iter()
            .map_err(|e| format!("{e}"))?
            .map(|i| i.map_err(|e| format!("{e}")).and_then(|i| value_of(&i)))
            .collect();
        return items.map(toml::Value::Array);
    }
    Err(format!(
        "{} is not a TOML value (str, int, float, bool, list, dict)",
        type_name(v)
    ))
}

/// How many writes carrying an immediate a receiver counts for one transfer: the `count` to
/// pass to `expect_imm_count`. Give exactly one shape: `nbytes` (a single write), `page_len`
/// with `pages` (a paged write), `scatter_lens` (the lengths of a scatter's destinations that
/// land on this receiver) or `barrier=True`. `nics` is the *sender's* NIC count; the stripe
/// knobs must be the sender's too (they come from the shared config).
#[pyfunction]
#[pyo3(signature = (nbytes=None, *, page_len=None, pages=None, scatter_lens=None, barrier=false, nics=1, min_stripe_len=None, align=None, max_chunk=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn expected_arrivals(
    py: Python<'_>,
    nbytes: Option<u64>,
    page_len: Option<u64>,
    pages: Option<u64>,
    scatter_lens: Option<Vec<u64>>,
    barrier: bool,
    nics: usize,
    min_stripe_len: Option<u64>,
    align: Option<u64>,
    max_chunk: Option<u64>,
) -> PyResult<u64> {
    let mut policy = engine_core::StripePolicy::default();
    policy.min_stripe_len = min_stripe_len.unwrap_or(policy.min_stripe_len);
    policy.align = align.unwrap_or(policy.align);
    policy.max_chunk = max_chunk.unwrap_or(policy.max_chunk);
    policy.validate().map_err(|e| errors::invalid(py, e))?;
    if !(1..=4).contains(&nics) {
        return Err(errors::invalid(
            py,
            format!("nics is {nics}: a DomainGroup has 1 to 4 NICs"),
        ));
    }
    arrivals(
        py,
        (nbytes, page_len, pages, scatter_lens.as_deref(), barrier),
        |shape| engine_core::expected_arrivals(shape, nics, &policy),
    )
}

/// The shape arguments of `expected_arrivals`, checked to name exactly one shape.
pub(crate) type ShapeArgs<'a> = (
    Option<u64>,
    Option<u64>,
    Option<u64>,
    Option<&'a [u64]>,
    bool,
);

/// Reads the shape arguments and asks `count` (a group's policy) how many arrivals it makes.
pub(crate) fn arrivals(
    py: Python<'_>,
    (nbytes, page_len, pages, lens, barrier): ShapeArgs<'_>,
    count: impl FnOnce(engine_core::TransferShape<'_>) -> u64,
) -> PyResult<u64> {
    use engine_core::TransferShape as S;
    let shape =
        match (nbytes, page_len, pages, lens, barrier) {
            (Some(len), None, None, None, false) => S::Single { len },
            (None, Some(page_len), Some(pages), None, false) => S::Paged { page_len, pages },
            (None, None, None, Some(lens), false) => S::Scatter { lens },
            (None, None, None, None, true) => S::Barrier,
            _ => return Err(errors::invalid(
                py,
                "give exactly one shape: nbytes, page_len and pages, scatter_lens, or barrier=True",
            )),
        };
    Ok(count(shape))
}

/// A `NetAddr` from a `NetAddr` or bytes.
/// An iterable of addresses (see [`addr_of`]), or `None` for "no restriction".
pub(crate) fn addrs_of(
    list: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<Vec<engine_core::NetAddr>>> {
    list.map(|list| list.try_iter()?.map(|p| addr_of(&p?)).collect())
        .transpose()
}

pub(crate) fn addr_of(obj: &Bound<'_, PyAny>) -> PyResult<engine_core::NetAddr> {
    if let Ok(a) = obj.cast::<NetAddr>() {
        return Ok(a.get().0.clone());
    }
    NetAddr::new(obj.py(), obj).map(|a| a.0)
}
