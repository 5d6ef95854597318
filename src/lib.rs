pub use verl_core;
