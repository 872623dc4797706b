//! Conversion between Arrow record batches and rows of JSON objects.
//!
//! Datasets are read into `serde_json` objects first, whatever the file format, so that one
//! function validates rows from parquet and JSONL alike. Writing goes the other way: an Arrow
//! schema is inferred from the JSON values (objects become structs, arrays become lists), which
//! is the layout pandas and pyarrow produce for the same data. A value whose type varies from row
//! to row (integers in some rows and fractions in others included, so that `2` does not come
//! back as `2.0`) is stored as JSON text in a string column whose field carries [`JSON_TEXT_KEY`]
//! metadata, so it still round-trips exactly.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, Float64Array, Int64Array, ListArray, RecordBatch,
    StringArray, StructArray,
};
use arrow::buffer::{NullBuffer, OffsetBuffer};
use arrow::datatypes::{
    DataType, Field, Fields, Float16Type, Float32Type, Float64Type, Int16Type, Int32Type,
    Int64Type, Int8Type, Schema, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use serde_json::{Map, Number, Value};

/// Field metadata key marking a string column whose values are JSON text.
pub(crate) const JSON_TEXT_KEY: &str = "floe.json";

/// Why a column could not be turned into JSON.
#[derive(Debug)]
pub(crate) struct UnsupportedColumn {
    /// Dotted path of the offending column, e.g. `extra_info.when`.
    pub(crate) column: String,
    /// Its Arrow type, printed.
    pub(crate) data_type: String,
}

/// Every row of `batch` as a JSON object keyed by column name.
pub(crate) fn batch_to_objects(
    batch: &RecordBatch,
) -> Result<Vec<Map<String, Value>>, UnsupportedColumn> {
    let mut rows = vec![Map::new(); batch.num_rows()];
    let schema = batch.schema();
    for (field, column) in schema.fields().iter().zip(batch.columns()) {
        let values = column_to_json(column.as_ref(), field, field.name())?;
        for (row, value) in rows.iter_mut().zip(values) {
            row.insert(field.name().clone(), value);
        }
    }
    Ok(rows)
}

fn column_to_json(
    array: &dyn Array,
    field: &Field,
    path: &str,
) -> Result<Vec<Value>, UnsupportedColumn> {
    let len = array.len();
    let is_null = |i: usize| array.is_null(i);
    let mut values: Vec<Value> = match array.data_type() {
        DataType::Null => vec![Value::Null; len],
        DataType::Boolean => {
            let a = array.as_boolean();
            (0..len).map(|i| Value::Bool(a.value(i))).collect()
        }
        DataType::Int8 => ints(array.as_primitive::<Int8Type>().values(), |v| v as i64),
        DataType::Int16 => ints(array.as_primitive::<Int16Type>().values(), |v| v as i64),
        DataType::Int32 => ints(array.as_primitive::<Int32Type>().values(), |v| v as i64),
        DataType::Int64 => ints(array.as_primitive::<Int64Type>().values(), |v| v),
        DataType::UInt8 => ints(array.as_primitive::<UInt8Type>().values(), |v| v as i64),
        DataType::UInt16 => ints(array.as_primitive::<UInt16Type>().values(), |v| v as i64),
        DataType::UInt32 => ints(array.as_primitive::<UInt32Type>().values(), |v| v as i64),
        DataType::UInt64 => array
            .as_primitive::<UInt64Type>()
            .values()
            .iter()
            .map(|&v| Value::Number(v.into()))
            .collect(),
        DataType::Float16 => floats(array.as_primitive::<Float16Type>().values(), f64::from),
        DataType::Float32 => floats(array.as_primitive::<Float32Type>().values(), f64::from),
        DataType::Float64 => floats(array.as_primitive::<Float64Type>().values(), |v| v),
        DataType::Utf8 => strings(array.as_string::<i32>().iter()),
        DataType::LargeUtf8 => strings(array.as_string::<i64>().iter()),
        DataType::Utf8View => strings(array.as_string_view().iter()),
        DataType::Binary => binaries(array.as_binary::<i32>().iter()),
        DataType::LargeBinary => binaries(array.as_binary::<i64>().iter()),
        DataType::List(child) => {
            let list = array.as_list::<i32>();
            let items = column_to_json(list.values().as_ref(), child, path)?;
            split_by_offsets(items, list.value_offsets().iter().map(|&o| o as usize))
        }
        DataType::LargeList(child) => {
            let list = array.as_list::<i64>();
            let items = column_to_json(list.values().as_ref(), child, path)?;
            split_by_offsets(items, list.value_offsets().iter().map(|&o| o as usize))
        }
        DataType::Struct(fields) => {
            let st = array.as_struct();
            let mut objects = vec![Map::new(); len];
            for (child_field, child) in fields.iter().zip(st.columns()) {
                let child_path = format!("{path}.{}", child_field.name());
                let child_values = column_to_json(child.as_ref(), child_field, &child_path)?;
                for (object, value) in objects.iter_mut().zip(child_values) {
                    // pandas and pyarrow fill keys a row lacks with nulls; dropping them gives
                    // back the dictionaries that were written.
                    if !value.is_null() {
                        object.insert(child_field.name().clone(), value);
                    }
                }
            }
            objects.into_iter().map(Value::Object).collect()
        }
        DataType::Map(_, _) => {
            let map = array.as_map();
            let keys = column_to_json(map.keys().as_ref(), field, &format!("{path}.key"))?;
            let vals = column_to_json(map.values().as_ref(), field, &format!("{path}.value"))?;
            let offsets: Vec<usize> = map.value_offsets().iter().map(|&o| o as usize).collect();
            offsets
                .windows(2)
                .map(|w| {
                    let mut object = Map::new();
                    for i in w[0]..w[1] {
                        let key = match &keys[i] {
                            Value::String(s) => s.clone(),
                            other => other.to_string(),
                        };
                        object.insert(key, vals[i].clone());
                    }
                    Value::Object(object)
                })
                .collect()
        }
        other => {
            // Dates, timestamps, decimals, dictionaries: their text form is what a dataset
            // consumer wants.
            let text =
                arrow::compute::cast(array, &DataType::Utf8).map_err(|_| UnsupportedColumn {
                    column: path.to_string(),
                    data_type: other.to_string(),
                })?;
            strings(text.as_string::<i32>().iter())
        }
    };
    for (i, value) in values.iter_mut().enumerate() {
        if is_null(i) {
            *value = Value::Null;
        }
    }
    if field.metadata().contains_key(JSON_TEXT_KEY) {
        for value in &mut values {
            if let Value::String(text) = value {
                if let Ok(parsed) = serde_json::from_str(text) {
                    *value = parsed;
                }
            }
        }
    }
    Ok(values)
}

fn ints<T: Copy>(values: &[T], to_i64: impl Fn(T) -> i64) -> Vec<Value> {
    values.iter().map(|&v| Value::from(to_i64(v))).collect()
}

fn floats<T: Copy>(values: &[T], to_f64: impl Fn(T) -> f64) -> Vec<Value> {
    values
        .iter()
        .map(|&v| Number::from_f64(to_f64(v)).map_or(Value::Null, Value::Number))
        .collect()
}

fn strings<'a>(values: impl Iterator<Item = Option<&'a str>>) -> Vec<Value> {
    values
        .map(|v| v.map_or(Value::Null, |s| Value::String(s.to_string())))
        .collect()
}

fn binaries<'a>(values: impl Iterator<Item = Option<&'a [u8]>>) -> Vec<Value> {
    values
        .map(|v| {
            v.map_or(Value::Null, |b| {
                Value::String(String::from_utf8_lossy(b).into())
            })
        })
        .collect()
}

fn split_by_offsets(items: Vec<Value>, offsets: impl Iterator<Item = usize>) -> Vec<Value> {
    let offsets: Vec<usize> = offsets.collect();
    let mut items = items.into_iter();
    let mut skipped = 0;
    let mut lists = Vec::with_capacity(offsets.len().saturating_sub(1));
    for w in offsets.windows(2) {
        // Sliced arrays may start past the beginning of their child values.
        while skipped < w[0] {
            items.next();
            skipped += 1;
        }
        let list: Vec<Value> = items.by_ref().take(w[1] - w[0]).collect();
        skipped = w[1];
        lists.push(Value::Array(list));
    }
    lists
}

/// The Arrow-side type of a set of JSON values.
#[derive(Debug, Clone, PartialEq)]
enum JsonType {
    Null,
    Bool,
    Int,
    Float,
    Str,
    List(Box<JsonType>),
    /// Fields in first-seen order.
    Struct(Vec<(String, JsonType)>),
    /// Mixed types: stored as JSON text.
    Text,
}

impl JsonType {
    fn of(value: &Value) -> JsonType {
        match value {
            Value::Null => JsonType::Null,
            Value::Bool(_) => JsonType::Bool,
            Value::Number(n) if n.is_i64() => JsonType::Int,
            Value::Number(n) if n.is_u64() => JsonType::Text,
            Value::Number(_) => JsonType::Float,
            Value::String(_) => JsonType::Str,
            Value::Array(items) => JsonType::List(Box::new(
                items
                    .iter()
                    .fold(JsonType::Null, |t, v| t.merge(JsonType::of(v))),
            )),
            Value::Object(object) => JsonType::Struct(
                object
                    .iter()
                    .map(|(k, v)| (k.clone(), JsonType::of(v)))
                    .collect(),
            ),
        }
    }

    fn merge(self, other: JsonType) -> JsonType {
        use JsonType::*;
        match (self, other) {
            (Null, t) | (t, Null) => t,
            (List(a), List(b)) => List(Box::new(a.merge(*b))),
            (Struct(mut a), Struct(b)) => {
                for (name, tb) in b {
                    match a.iter_mut().find(|(n, _)| *n == name) {
                        Some((_, ta)) => *ta = std::mem::replace(ta, Null).merge(tb),
                        None => a.push((name, tb)),
                    }
                }
                Struct(a)
            }
            (a, b) if a == b => a,
            _ => Text,
        }
    }

    /// Arrow's type for this JSON type; empty structs and all-null columns become JSON text
    /// and plain nullable strings, which every parquet reader handles.
    fn field(&self, name: &str) -> Field {
        let data_type = match self {
            JsonType::Null | JsonType::Str => DataType::Utf8,
            JsonType::Bool => DataType::Boolean,
            JsonType::Int => DataType::Int64,
            JsonType::Float => DataType::Float64,
            JsonType::List(item) => DataType::List(Arc::new(item.field("item"))),
            JsonType::Struct(fields) if !fields.is_empty() => {
                DataType::Struct(fields.iter().map(|(n, t)| t.field(n)).collect::<Fields>())
            }
            JsonType::Struct(_) | JsonType::Text => {
                return Field::new(name, DataType::Utf8, true).with_metadata(HashMap::from([(
                    JSON_TEXT_KEY.to_string(),
                    "true".to_string(),
                )]));
            }
        };
        Field::new(name, data_type, true)
    }

    fn build(&self, values: &[Option<&Value>]) -> ArrayRef {
        fn present<'a>(v: &Option<&'a Value>) -> Option<&'a Value> {
            v.filter(|v| !v.is_null())
        }
        match self {
            JsonType::Null | JsonType::Str => Arc::new(StringArray::from_iter(
                values.iter().map(|v| present(v).and_then(Value::as_str)),
            )),
            JsonType::Bool => Arc::new(BooleanArray::from_iter(
                values.iter().map(|v| present(v).and_then(Value::as_bool)),
            )),
            JsonType::Int => Arc::new(Int64Array::from_iter(
                values.iter().map(|v| present(v).and_then(Value::as_i64)),
            )),
            JsonType::Float => Arc::new(Float64Array::from_iter(
                values.iter().map(|v| present(v).and_then(Value::as_f64)),
            )),
            JsonType::List(item) => {
                let mut lengths = Vec::with_capacity(values.len());
                let mut children = Vec::new();
                for v in values {
                    let items = present(v).and_then(Value::as_array);
                    lengths.push(items.map_or(0, Vec::len));
                    children.extend(items.into_iter().flatten().map(Some));
                }
                let field = Arc::new(item.field("item"));
                Arc::new(ListArray::new(
                    field,
                    OffsetBuffer::from_lengths(lengths),
                    item.build(&children),
                    nulls(values),
                ))
            }
            JsonType::Struct(fields) if !fields.is_empty() => {
                let columns = fields
                    .iter()
                    .map(|(name, t)| {
                        let child: Vec<Option<&Value>> = values
                            .iter()
                            .map(|v| present(v).and_then(|o| o.get(name)))
                            .collect();
                        t.build(&child)
                    })
                    .collect();
                let fields: Fields = fields.iter().map(|(n, t)| t.field(n)).collect();
                Arc::new(StructArray::new(fields, columns, nulls(values)))
            }
            JsonType::Struct(_) | JsonType::Text => {
                Arc::new(StringArray::from_iter(values.iter().map(|v| {
                    present(v).map(|v| serde_json::to_string(v).expect("JSON values serialize"))
                })))
            }
        }
    }
}

fn nulls(values: &[Option<&Value>]) -> Option<NullBuffer> {
    let valid: Vec<bool> = values
        .iter()
        .map(|v| v.is_some_and(|v| !v.is_null()))
        .collect();
    Some(NullBuffer::from(valid))
}

/// A record batch holding `rows`, one column per key in `columns` (in that order), with types
/// inferred from the values.
pub(crate) fn objects_to_batch(
    rows: &[Map<String, Value>],
    columns: &[&str],
) -> Result<RecordBatch, arrow::error::ArrowError> {
    let mut fields = Vec::with_capacity(columns.len());
    let mut arrays = Vec::with_capacity(columns.len());
    for &name in columns {
        let values: Vec<Option<&Value>> = rows.iter().map(|row| row.get(name)).collect();
        let ty = values
            .iter()
            .flatten()
            .fold(JsonType::Null, |t, v| t.merge(JsonType::of(v)));
        fields.push(ty.field(name));
        arrays.push(ty.build(&values));
    }
    RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays)
}
