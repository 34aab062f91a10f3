mod logging;
