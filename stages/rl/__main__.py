from stages.rl.driver import main

if __name__ == "__main__":
    main()
