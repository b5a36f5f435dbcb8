"""The benchmarks' library: the scripts in benchmarks/ are thin layers over these modules (see benchmarks/README.md)."""
